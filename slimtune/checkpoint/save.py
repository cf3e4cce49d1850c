"""Checkpoint directories from tensor streams: ``write_checkpoint`` is the one place that lays out a
checkpoint (PEFT adapter, merged HF shards, config, tokenizer, manifest last, atomically);
``save_checkpoint`` feeds it from a live QLoRA model, the offline merge from files."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slimtune.checkpoint.atomic import atomic_directory, check_free_space, sha256_file, write_manifest
from slimtune.checkpoint.staging import pool_for
from slimtune.checkpoint.stream import StreamTensor, adapter_tensor_stream, merged_tensor_stream
from slimtune.checkpoint.writer import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_INFLIGHT_BYTES,
    FileRecord,
    file_size,
    sharded_size,
    write_json,
    write_safetensors,
    write_sharded,
)
from slimtune.formats.hf import export_config_dict, tokenizer_files
from slimtune.formats.peft import ADAPTER_CONFIG, ADAPTER_DIR_NAME, ADAPTER_WEIGHTS, adapter_config_dict
from slimtune.memory import parse_size

ADAPTER_DIR = ADAPTER_DIR_NAME
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # as the CLI and configs spell them
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # as config.json does


@dataclass
class SaveResult:
    path: Path
    files: list[FileRecord]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def write_checkpoint(
    out_dir: str | Path,
    *,
    merged: list[StreamTensor],
    config: dict | None = None,
    tokenizer_dir: Path | None = None,
    adapter: list[StreamTensor] | None = None,
    adapter_config: dict | None = None,
    extra_files: dict[str, Path] | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    progress: bool = True,
    manifest_extra: dict | None = None,
) -> SaveResult:
    """Lay out a checkpoint directory from streams, in bounded memory: disk space checked against the
    exact byte count first, everything written into a temporary sibling, the manifest last."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    max_shard_bytes = parse_size(max_shard_size)
    needed = sharded_size(merged, max_shard_bytes) if merged else 0
    needed += file_size(adapter, {"format": "pt"}) if adapter is not None else 0
    needed += sum(Path(p).stat().st_size for p in (extra_files or {}).values())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out_dir.parent, needed)
    total = sum(t.nbytes for t in (adapter or []) + merged)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"write {out_dir.name}", disable=not progress)
    with atomic_directory(out_dir, overwrite) as tmp, bar:
        records: list[FileRecord] = []
        if adapter is not None:
            (tmp / ADAPTER_DIR).mkdir()
            records.append(_prefixed(write_json(tmp / ADAPTER_DIR / ADAPTER_CONFIG, adapter_config or {})))
            weights = write_safetensors(tmp / ADAPTER_DIR / ADAPTER_WEIGHTS, adapter, {"format": "pt"}, chunk_bytes, bar, inflight_bytes)
            records.append(_prefixed(weights))
        if merged:
            records += write_sharded(tmp, merged, max_shard_bytes, chunk_bytes, bar, inflight_bytes)
            if config is not None:
                records.append(write_json(tmp / "config.json", config))
            if tokenizer_dir is not None:
                records += [_copy(src, tmp / src.name) for src in tokenizer_files(tokenizer_dir)]
        for name, src in (extra_files or {}).items():
            records.append(_copy(Path(src), tmp / name))
        write_manifest(tmp, records, manifest_extra)
    return SaveResult(out_dir, records, time.perf_counter() - start)


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    max_shard_size: str | int = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    extra_files: dict[str, Path] | None = None,
    progress: bool = True,
) -> SaveResult:
    """Write ``out_dir`` holding ``adapter/`` (PEFT) and, unless ``adapter_only``, the merged model in
    Hugging Face sharded safetensors with config and tokenizer files, then ``slimtune_manifest.json``.
    ``dtype`` defaults to the base dtype. ``extra_files`` (name -> path) are copied in (recipe state)."""
    source_dir = getattr(model, "slimtune_source_dir", None)
    on_gpu = any(p.is_cuda for p in model.parameters())
    to_host = pool_for(chunk_bytes, inflight_bytes, pin_memory=on_gpu).to_host
    merged = [] if adapter_only else merged_tensor_stream(model, dtype, to_host)
    hf_config = getattr(model, "config", None)
    config = None
    if merged and hf_config is not None:
        config = export_config_dict(hf_config, DTYPE_NAMES.get(dtype or merged[0].dtype))
    return write_checkpoint(
        out_dir,
        merged=merged,
        config=config,
        tokenizer_dir=source_dir,
        adapter=adapter_tensor_stream(model),
        adapter_config=adapter_config_dict(model, str(source_dir or "")),
        extra_files=extra_files,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        chunk_bytes=chunk_bytes,
        inflight_bytes=inflight_bytes,
        progress=progress,
        manifest_extra={"kind": "adapter" if adapter_only else "adapter+merged"},
    )


def _prefixed(record: FileRecord) -> FileRecord:
    return FileRecord(f"{ADAPTER_DIR}/{record.path}", record.size, record.sha256)


def _copy(src: Path, dst: Path) -> FileRecord:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(dst.name, dst.stat().st_size, sha256_file(dst))
