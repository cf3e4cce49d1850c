"""save_checkpoint: a QLoRA model to a checkpoint directory (PEFT adapter + merged HF model), written
from the tensor stream in bounded memory, atomically, completed by a manifest."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slimtune.checkpoint.atomic import atomic_directory, check_free_space, sha256_file, write_manifest
from slimtune.checkpoint.stream import adapter_tensor_stream, merged_tensor_stream
from slimtune.checkpoint.writer import (
    DEFAULT_CHUNK_BYTES,
    FileRecord,
    file_size,
    sharded_size,
    write_json,
    write_safetensors,
    write_sharded,
)
from slimtune.formats.hf import export_config_dict, tokenizer_files
from slimtune.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config_dict
from slimtune.formats.safetensors import DTYPE_TO_NAME
from slimtune.memory import parse_size

ADAPTER_DIR = "adapter"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class SaveResult:
    path: Path
    files: list[FileRecord]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    max_shard_size: str | int = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    extra_files: dict[str, Path] | None = None,
    progress: bool = True,
) -> SaveResult:
    """Write ``out_dir`` holding ``adapter/`` (PEFT) and, unless ``adapter_only``, the merged model in
    Hugging Face sharded safetensors with config and tokenizer files, then ``slimtune_manifest.json``.
    ``dtype`` defaults to the base dtype. ``extra_files`` (name -> path) are copied in (recipe state)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    source_dir = getattr(model, "slimtune_source_dir", None)
    adapter = adapter_tensor_stream(model)
    merged = [] if adapter_only else merged_tensor_stream(model, dtype)
    max_shard_bytes = parse_size(max_shard_size)
    needed = file_size(adapter, {"format": "pt"}) + (sharded_size(merged, max_shard_bytes) if merged else 0)
    needed += sum(p.stat().st_size for p in (extra_files or {}).values())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out_dir.parent, needed)
    total = sum(t.nbytes for t in adapter + merged)
    with (
        atomic_directory(out_dir, overwrite) as tmp,
        tqdm(total=total, unit="B", unit_scale=True, desc=f"save {out_dir.name}", disable=not progress) as bar,
    ):
        records: list[FileRecord] = []
        (tmp / ADAPTER_DIR).mkdir()
        config = adapter_config_dict(model, str(source_dir or ""))
        records.append(_prefixed(write_json(tmp / ADAPTER_DIR / ADAPTER_CONFIG, config)))
        records.append(_prefixed(write_safetensors(tmp / ADAPTER_DIR / ADAPTER_WEIGHTS, adapter, {"format": "pt"}, chunk_bytes, bar)))
        if merged:
            records += write_sharded(tmp, merged, max_shard_bytes, chunk_bytes, bar)
            out_dtype = merged[0].dtype if dtype is None else dtype
            hf_config = getattr(model, "config", None)
            if hf_config is not None:
                records.append(write_json(tmp / "config.json", export_config_dict(hf_config, DTYPE_NAMES.get(out_dtype))))
            if source_dir is not None:
                for src in tokenizer_files(source_dir):
                    records.append(_copy(src, tmp / src.name))
        for name, src in (extra_files or {}).items():
            records.append(_copy(Path(src), tmp / name))
        write_manifest(tmp, records, {"adapter_only": adapter_only, "dtype": DTYPE_TO_NAME.get(dtype) if dtype else None})
    return SaveResult(out_dir, records, time.perf_counter() - start)


def _prefixed(record: FileRecord) -> FileRecord:
    return FileRecord(f"{ADAPTER_DIR}/{record.path}", record.size, record.sha256)


def _copy(src: Path, dst: Path) -> FileRecord:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        import os

        os.fsync(f.fileno())
    return FileRecord(dst.name, dst.stat().st_size, sha256_file(dst))
