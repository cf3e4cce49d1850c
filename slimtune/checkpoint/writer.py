"""Consumes a tensor stream into safetensors files: shards planned from known sizes, each file's header
written first, then every tensor's bytes in row chunks, straight from the producer to the file."""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.checkpoint.stream import StreamTensor, row_chunks
from slimtune.formats.hf import INDEX_NAME, index_dict, shard_name
from slimtune.formats.safetensors import SafetensorsWriter, build_header

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024  # output bytes per chunk; fp32 temporaries make the peak ~8x this
DEFAULT_INFLIGHT_BYTES = 16 * 1024 * 1024  # finished chunks waiting for the writer: two suffice to overlap


@dataclass(frozen=True)
class FileRecord:
    """A file as the manifest lists it."""

    path: str
    size: int
    sha256: str


def plan_shards(stream: list[StreamTensor], max_shard_bytes: int) -> list[list[StreamTensor]]:
    """Greedy packing in stream order, as transformers does: a tensor larger than the limit gets a shard alone."""
    shards: list[list[StreamTensor]] = [[]]
    size = 0
    for t in stream:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def file_size(tensors: list[StreamTensor], metadata: dict[str, str] | None = None) -> int:
    header, entries = build_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)
    return len(header) + (entries[-1].end if entries else 0)


def pipelined_write(writer: SafetensorsWriter, chunks: Iterator[torch.Tensor], inflight_bytes: int, bar: tqdm | None = None) -> None:
    """Compute chunk i+1 while a writer thread writes (and hashes) chunk i. Torch ops, file writes and
    sha256 all release the GIL, so production and I/O overlap; at most ``inflight_bytes`` of finished
    chunks wait at any time (one chunk always may, however large)."""
    pending: queue.Queue[torch.Tensor | None] = queue.Queue()
    budget = threading.Condition()
    state = {"inflight": 0, "error": None}

    def consume() -> None:
        while (chunk := pending.get()) is not None:
            nbytes = chunk.numel() * chunk.element_size()
            try:
                if state["error"] is None:
                    writer.write(chunk)
                    if bar is not None:
                        bar.update(nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the producer, which raises it
                state["error"] = e
            finally:
                del chunk
                with budget:
                    state["inflight"] -= nbytes
                    budget.notify()

    thread = threading.Thread(target=consume, name="slimtune-writer", daemon=True)
    thread.start()
    try:
        for chunk in chunks:
            nbytes = chunk.numel() * chunk.element_size()
            with budget:
                budget.wait_for(
                    lambda n=nbytes: state["error"] is not None or state["inflight"] == 0 or state["inflight"] + n <= inflight_bytes
                )
                if state["error"] is not None:
                    break
                state["inflight"] += nbytes
            pending.put(chunk)
            del chunk
    finally:
        pending.put(None)
        thread.join()
    if state["error"] is not None:
        raise state["error"]


def write_safetensors(
    path: Path,
    tensors: list[StreamTensor],
    metadata: dict[str, str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bar: tqdm | None = None,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
) -> FileRecord:
    """Write one file from its stream entries; returns its manifest record (hash taken while writing)."""
    with SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in tensors], metadata) as writer:
        chunks = (chunk for t in tensors for chunk in row_chunks(t, chunk_bytes))
        pipelined_write(writer, chunks, inflight_bytes, bar)
    return FileRecord(path.name, writer.size, writer.sha256)


def write_json(path: Path, data: object) -> FileRecord:
    """A small JSON file written and fsynced; returns its record."""
    import hashlib

    raw = (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(path.name, len(raw), hashlib.sha256(raw).hexdigest())


def write_sharded(
    out_dir: Path,
    stream: list[StreamTensor],
    max_shard_bytes: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bar: tqdm | None = None,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
) -> list[FileRecord]:
    """Hugging Face sharded layout: model-0000i-of-0000N.safetensors plus model.safetensors.index.json."""
    shards = plan_shards(stream, max_shard_bytes)
    records, weight_map = [], {}
    for i, tensors in enumerate(shards):
        name = shard_name(i, len(shards))
        records.append(write_safetensors(out_dir / name, tensors, {"format": "pt"}, chunk_bytes, bar, inflight_bytes))
        weight_map.update({t.name: name for t in tensors})
    total = sum(t.nbytes for t in stream)
    records.append(write_json(out_dir / INDEX_NAME, index_dict(weight_map, total)))
    return records


def sharded_size(stream: list[StreamTensor], max_shard_bytes: int) -> int:
    """Bytes the shards will take (headers included), known before writing: for the disk-space check."""
    return sum(file_size(s, {"format": "pt"}) for s in plan_shards(stream, max_shard_bytes))
