"""Checkpoint directories from tensor streams: ``write_checkpoint`` is the one place that lays out a
checkpoint (PEFT adapter, merged HF shards, config, tokenizer, manifest last, atomically);
``save_checkpoint`` feeds it from a live QLoRA model, the offline merge from files."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn
from tqdm.auto import tqdm

from slimtune.checkpoint.atomic import atomic_directory
from slimtune.checkpoint.plan import plan_save
from slimtune.checkpoint.staging import pool_for
from slimtune.checkpoint.stream import adapter_tensor_stream, merged_tensor_stream
from slimtune.checkpoint.writer import FILE_LANES, WriteOptions, create_files, write_json, write_planned
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.fileio import check_free_space, os_errors
from slimtune.formats.hf import INDEX_NAME, export_config_dict, index_dict, read_config_dict, tokenizer_files
from slimtune.formats.layout import ADAPTER_CONFIG, ADAPTER_DIR
from slimtune.formats.manifest import FileRecord, sha256_file, write_manifest
from slimtune.formats.peft_config import adapter_config_dict
from slimtune.lora import lora_modules
from slimtune.tensors import StreamTensor
from slimtune.vision_families import peft_exclude_modules

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)
__all__ = ["CheckpointParts", "ExtraFile", "SaveOptions", "SaveResult", "save_checkpoint", "write_checkpoint"]


@dataclass(frozen=True)
class ExtraFile:
    """A file made straight inside the checkpoint by ``write(path)`` (the recipe state), after the
    free-space check; ``size`` (an upper estimate) counts toward that check."""

    size: int
    write: Callable[[Path], None]


@dataclass
class SaveResult:
    path: Path
    files: list[FileRecord]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class CheckpointParts:
    """What ``write_checkpoint`` lays out: the merged model's stream (empty: adapter only) with its config
    and tokenizer files, the PEFT adapter's stream and config, extra files, the manifest's extra fields;
    ``whole_below``: tensors smaller than this many bytes are written whole by one rank (every rank can
    make any rows of them); ``shared_write(tmp)``: files every rank writes together (the training state,
    through DCP), returning their paths relative to ``tmp``; ``file_lanes``: how many files one process
    may write at once (``write_planned``), more than 1 only for streams that make any tensor's rows at any
    time, from any thread (a model in memory; not a stream reading a base in file order)."""

    merged: list[StreamTensor]
    config: dict | None = None
    tokenizer_dir: Path | None = None
    adapter: list[StreamTensor] | None = None
    adapter_config: dict | None = None
    extra_files: dict[str, Path | ExtraFile] | None = None
    manifest_extra: dict | None = None
    whole_below: int = 0
    shared_write: Callable[[Path], list[str]] | None = None
    file_lanes: int = 1


@dataclass(frozen=True)
class SaveOptions:
    """A live model's save: how it is written (``write``) and the files it carries beside the weights:
    ``extra_files`` (relative name -> file, or an ``ExtraFile`` made in place: recipe state, model card)
    and ``tokenizer_dir``, the merged model's tokenizer files (default: the base's); ``file_lanes``, the
    files written at once (``FILE_LANES``; a background writer, which shares the cores with training,
    writes one at a time).

    Example: ``SaveOptions(WriteOptions(adapter_only=True, progress=False))``"""

    write: WriteOptions = WriteOptions()
    extra_files: dict[str, Path | ExtraFile] | None = None
    tokenizer_dir: Path | None = None
    file_lanes: int = FILE_LANES


def write_checkpoint(
    out_dir: str | Path, parts: CheckpointParts, options: WriteOptions = WriteOptions(), ranks: Ranks = SINGLE
) -> SaveResult:
    """Lay out a checkpoint directory from streams, in bounded memory, on one rank or many. Every rank
    calls this with streams of the same shapes (each can make the rows the plan gives it; tensors below
    ``parts.whole_below`` bytes are written whole by one rank). The coordinator checks the disk space against
    the planned byte count, creates a temporary sibling and every shard at its final size; each rank
    writes its rows (``write_planned``); the coordinator adds the small files and the manifest last,
    then renames. ``parts.shared_write(tmp)`` runs on every rank once the shards are written, for files the
    ranks write together (the training state, through DCP); it returns their paths relative to ``tmp``,
    which the coordinator hashes into the manifest (reading them back: they are small). Any rank's
    failure stops every rank and leaves no checkpoint and no manifest. A failed
    write (full disk, file-size limit, read-only file system) is one ``SlimtuneError`` line; nothing of
    it stays behind (nor any parent directory made for it) and an earlier checkpoint at ``out_dir`` is
    untouched.

    Example: ``write_checkpoint(out, CheckpointParts(merged=stream, config=cfg), WriteOptions(progress=False))``"""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    merged, adapter, extra_files, shared_write = parts.merged, parts.adapter, parts.extra_files, parts.shared_write
    plan = plan_save(merged, adapter, options.shard_bytes, ranks.world_size, parts.whole_below)
    if len(set(ranks.gather(plan.digest(), "planning the save"))) > 1:
        raise SlimtuneError(f"{out_dir}: the ranks computed different save plans (their models or streams differ)")
    bar = tqdm(
        total=plan.bytes_of(ranks.rank),
        unit="B",
        unit_scale=True,
        desc=f"write {out_dir.name}" + (f" ({ranks.world_size} ranks)" if ranks.world_size > 1 else ""),
        disable=not (options.progress and ranks.is_coordinator),
    )
    with bar:
        if not ranks.is_coordinator:
            ranks.agree(None, "creating the files")
            tmp = Path(ranks.broadcast(None, "creating the files"))
            with os_errors("write", out_dir):
                records = write_planned(tmp, plan, ranks, options, bar)
                if shared_write is not None:
                    try:
                        shared_write(tmp)
                    except BaseException as e:
                        ranks.agree(e, "finishing the checkpoint")
            ranks.agree(None, "finishing the checkpoint")
            return SaveResult(out_dir, records, time.perf_counter() - start)
        pending = "creating the files"  # the step the other ranks wait at for the coordinator's status
        try:
            needed = plan.size + sum(p.size if isinstance(p, ExtraFile) else Path(p).stat().st_size for p in (extra_files or {}).values())
            check_free_space(out_dir.parent, needed)
            with os_errors("write", out_dir, needed), atomic_directory(out_dir, options.overwrite) as tmp:
                create_files(tmp, plan)
                pending = None
                ranks.agree(None, "creating the files")
                ranks.broadcast(str(tmp), "creating the files")
                written = write_planned(tmp, plan, ranks, options, bar, parts.file_lanes)
                pending = "finishing the checkpoint"
                records: list[FileRecord] = []
                if adapter is not None:
                    records.append(_prefixed(write_json(tmp / ADAPTER_DIR / ADAPTER_CONFIG, parts.adapter_config or {})))
                records += written
                for name in shared_write(tmp) if shared_write is not None else []:
                    records.append(_synced_record(tmp / name, name))
                if merged:
                    records.append(write_json(tmp / INDEX_NAME, index_dict(plan.weight_map, plan.merged_bytes)))
                    if parts.config is not None:
                        records.append(write_json(tmp / "config.json", parts.config))
                    if parts.tokenizer_dir is not None:
                        records += [_copy(src, tmp / src.name) for src in tokenizer_files(parts.tokenizer_dir)]
                for name, src in (extra_files or {}).items():
                    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                    if isinstance(src, ExtraFile):
                        src.write(tmp / name)
                        records.append(_synced_record(tmp / name, name))
                    else:
                        records.append(_copy(Path(src), tmp / name, name))
                write_manifest(tmp, records, parts.manifest_extra)
        except BaseException as e:
            if pending:
                ranks.agree(e, pending)
            raise
        ranks.agree(None, pending)
    return SaveResult(out_dir, records, time.perf_counter() - start)


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    options: SaveOptions | WriteOptions = SaveOptions(),
    ranks: Ranks = SINGLE,
    shared_write: Callable[[Path], list[str]] | None = None,
) -> SaveResult:
    """Write ``out_dir`` holding ``adapter/`` (PEFT) and, unless ``adapter_only``, the merged model in
    Hugging Face sharded safetensors with config and tokenizer files, then ``slimtune_manifest.json``.
    ``options`` is a ``SaveOptions`` or just its ``WriteOptions``; the merged dtype defaults to the base
    dtype. Extra files (relative name -> path) are copied in (recipe state, model card); the merged
    model's tokenizer files come from ``tokenizer_dir`` (default: the base's).
    On an FSDP2-sharded model every rank calls this with its ``ranks``; each writes the merged rows of
    the weights it holds into the same files (the cooperative export of ``write_checkpoint``);
    ``shared_write`` is passed on to it.

    Example: ``save_checkpoint(model, "out/ckpt", WriteOptions(max_shard_size="2GB", progress=False))``"""
    if isinstance(options, WriteOptions):
        options = SaveOptions(options)
    write = options.write
    source_dir = _source_dir(model)
    on_gpu = any(p.is_cuda for p in model.parameters())
    to_host = pool_for(write.chunk_bytes, write.inflight_bytes, pin_memory=on_gpu).to_host
    merged = [] if write.adapter_only else merged_tensor_stream(model, write.torch_dtype, to_host)
    base_config = _base_config(model) if merged else None
    config = export_config_dict(base_config, merged) if base_config is not None else None
    parts = CheckpointParts(
        merged=merged,
        config=config,
        tokenizer_dir=options.tokenizer_dir or source_dir,
        adapter=adapter_tensor_stream(model),
        adapter_config=adapter_config_dict(lora_modules(model), _base_name(model), peft_exclude_modules(model, lora_modules(model))),
        extra_files=options.extra_files,
        manifest_extra={"kind": "adapter" if write.adapter_only else "adapter+merged"},
        shared_write=shared_write,
        file_lanes=options.file_lanes,
    )
    return write_checkpoint(out_dir, parts, write, ranks)


def _base_config(model: nn.Module) -> dict | PretrainedConfig | None:
    """The config the merged model is written with: the base's config.json, as the offline merge writes
    it (not ``model.config``: training changes ``use_cache``); the model's config if the base directory
    is gone or was never there (a model built in memory)."""
    source_dir = _source_dir(model)
    if source_dir is not None:
        try:
            return read_config_dict(source_dir)
        except SlimtuneError as e:
            log.warning("%s; config.json written from the model's config instead", e)
    return getattr(model, "config", None)


def _source_dir(model: nn.Module) -> Path | None:
    facts = facts_of(model)
    return facts.source_dir if facts is not None else None


def _base_name(model: nn.Module) -> str:
    """The adapter's ``base_model_name_or_path``: the hub id the base came from, else its directory."""
    facts = facts_of(model)
    return (facts.base_name or str(facts.source_dir or "")) if facts is not None else ""


def _prefixed(record: FileRecord) -> FileRecord:
    return FileRecord(f"{ADAPTER_DIR}/{record.path}", record.size, record.sha256)


def _copy(src: Path, dst: Path, name: str | None = None) -> FileRecord:
    shutil.copyfile(src, dst)
    return _synced_record(dst, name)


def _synced_record(dst: Path, name: str | None = None) -> FileRecord:
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(name or dst.name, dst.stat().st_size, sha256_file(dst))
