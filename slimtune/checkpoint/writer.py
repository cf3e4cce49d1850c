"""Consumes tensor streams into safetensors files by a plan (``plan.py``): the coordinator creates each
file with its header at its final size, then every rank writes its rows of every tensor straight at
their offsets, in row chunks, from the producer to the file. One process is the world of size 1 of
the same mechanism."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.checkpoint.plan import FilePlan, SavePlan, TensorSlot, plan_files, plan_save
from slimtune.checkpoint.stream import StreamTensor, row_chunks
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.formats.hf import INDEX_NAME, index_dict
from slimtune.formats.safetensors import tensor_bytes
from slimtune.memory import parse_size

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024  # output bytes per chunk; fp32 temporaries make the peak ~8x this
DEFAULT_INFLIGHT_BYTES = 16 * 1024 * 1024  # finished chunks waiting for the writer: two suffice to overlap


@dataclass(frozen=True)
class WriteOptions:
    """How a checkpoint is written; every save, merge and export takes one of these.

    Example: ``WriteOptions(max_shard_size="2GB", overwrite=True, progress=False)``."""

    max_shard_size: str | int = "5GB"
    """Largest merged shard; decimal units as Hugging Face uses ("5GB" = 5e9 bytes)."""
    overwrite: bool = False
    """Replace an existing directory (atomically, once the new checkpoint is complete)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Output bytes made per chunk (at least one row)."""
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    """Finished chunks that may wait for the writer thread."""
    progress: bool = True
    """A progress bar on the coordinator."""


@dataclass(frozen=True)
class FileRecord:
    """A file as the manifest lists it."""

    path: str
    size: int
    sha256: str


def pipelined_write(writer, chunks: Iterator[torch.Tensor], inflight_bytes: int, bar: tqdm | None = None) -> None:
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


class _RowSink:
    """Takes one rank's chunks of one file in plan order and writes each at its offset with pwrite
    (hashing them too when this rank writes the whole file, so that file needs no read back)."""

    def __init__(self, fd: int, path: Path, slots: list[tuple[TensorSlot, int, int]], sha=None):
        self.fd, self.path, self.sha = fd, path, sha
        self.pieces = [(s, s.offset + a * s.row_bytes, (b - a) * s.row_bytes) for s, a, b in slots if b > a]
        self.index, self.done = 0, 0

    def write(self, chunk: torch.Tensor) -> None:
        if self.index >= len(self.pieces):
            raise SlimtuneError(f"{self.path}: more data than the plan gives this rank")
        slot, offset, nbytes = self.pieces[self.index]
        if chunk.dtype != slot.dtype:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: got {chunk.dtype}, the header says {slot.dtype}")
        data = tensor_bytes(chunk)
        if self.done + len(data) > nbytes:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: more bytes than its rows {list(slot.shape)}")
        _pwrite_all(self.fd, data, offset + self.done)
        if self.sha is not None:
            self.sha.update(data)
        self.done += len(data)
        if self.done == nbytes:
            self.index, self.done = self.index + 1, 0

    def check_complete(self) -> None:
        if self.index < len(self.pieces):
            raise SlimtuneError(f"{self.path}: tensor {self.pieces[self.index][0].name}: the stream ended before its rows were written")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def create_files(directory: Path, plan: SavePlan) -> None:
    """The coordinator's part before anyone writes: every file with its header, at its final size
    (the tensor bytes are a hole until the ranks fill them, so nothing is written twice)."""
    for f in plan.files:
        path = directory / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def write_planned(directory: Path, plan: SavePlan, ranks: Ranks, options: WriteOptions, bar: tqdm | None = None) -> list[FileRecord]:
    """Every rank's part: its rows of every tensor, file by file, straight at their offsets; fsync; then
    one status exchange per file (a failed rank stops every rank there). A file written whole by one
    rank is hashed as it is written; any other file is read back by its planned hasher rank, in a
    thread, while the ranks go on with the next file. Returns every file's record, on every rank."""
    from slimtune.checkpoint.atomic import sha256_file

    rank = ranks.rank
    hashes: dict[str, str] = {}
    readers: list[threading.Thread] = []
    read_errors: list[BaseException] = []

    def read_back(path: str) -> None:
        try:
            hashes[path] = sha256_file(directory / path)
        except BaseException as e:  # noqa: BLE001 - reported at the next status exchange
            read_errors.append(e)

    try:
        for f, hasher in zip(plan.files, plan.hashers, strict=True):
            error = None
            try:
                _write_file_part(directory, f, rank, hasher == rank and f.sole_writer(plan.world_size) == rank, options, bar, hashes)
            except Exception as e:  # noqa: BLE001 - every rank learns of it at the exchange below
                error = e
            ranks.agree(error, f"writing {f.path}")
            if hasher == rank and f.path not in hashes:
                readers.append(threading.Thread(target=read_back, args=(f.path,), name="slimtune-hash", daemon=True))
                readers[-1].start()
    finally:
        for t in readers:
            t.join()
    ranks.agree(read_errors[0] if read_errors else None, "hashing the files")
    for part in ranks.gather(hashes, "collecting the hashes"):
        hashes.update(part)
    return [FileRecord(f.path, f.size, hashes[f.path]) for f in plan.files]


def _write_file_part(
    directory: Path, f: FilePlan, rank: int, hash_now: bool, options: WriteOptions, bar: tqdm | None, hashes: dict[str, str]
) -> None:
    mine = [(s, *s.ranges[rank]) for s in f.slots]
    if not f.bytes_of(rank) and not hash_now:
        return
    path = directory / f.path
    fd = os.open(path, os.O_WRONLY)
    try:
        sink = _RowSink(fd, path, mine, hashlib.sha256(f.header) if hash_now else None)
        chunks = (c for s, a, b in mine for c in row_chunks(s.source, options.chunk_bytes, a, b))
        pipelined_write(sink, chunks, options.inflight_bytes, bar)
        sink.check_complete()
        os.fsync(fd)
    finally:
        os.close(fd)
    if sink.sha is not None:
        hashes[f.path] = sink.sha.hexdigest()


def write_safetensors(path: Path, tensors: list[StreamTensor], options: WriteOptions = WriteOptions()) -> FileRecord:
    """One safetensors file from stream entries, by the planned writer (one process); returns its record."""
    plan = plan_files([(path.name, tensors)])
    create_files(path.parent, plan)
    return write_planned(path.parent, plan, SINGLE, options)[0]


def write_json(path: Path, data: object) -> FileRecord:
    """A small JSON file written and fsynced; returns its record."""
    raw = (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(path.name, len(raw), hashlib.sha256(raw).hexdigest())


def write_sharded(out_dir: Path, stream: list[StreamTensor], options: WriteOptions = WriteOptions()) -> list[FileRecord]:
    """Hugging Face sharded layout, one process: model-0000i-of-0000N.safetensors plus the index."""
    plan = plan_save(stream, None, parse_size(options.max_shard_size))
    create_files(out_dir, plan)
    records = write_planned(out_dir, plan, SINGLE, options)
    return records + [write_json(out_dir / INDEX_NAME, index_dict(plan.weight_map, plan.merged_bytes))]
