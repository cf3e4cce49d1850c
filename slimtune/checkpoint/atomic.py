"""Checkpoint directories that appear whole or not at all: written in a temporary sibling, fsynced,
completed by a manifest (files, sizes, sha256), then renamed into place. An earlier checkpoint at the
same path is swapped out only after the new one is complete."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimtune.checkpoint.writer import FileRecord
from slimtune.errors import SlimtuneError

MANIFEST_NAME = "slimtune_manifest.json"
MANIFEST_FORMAT = "slimtune-checkpoint/1"


def check_free_space(directory: Path, needed: int, margin: int = 16 * 1024 * 1024) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + margin:
        raise SlimtuneError(
            f"not enough disk space in {directory}: the checkpoint needs {needed:,} bytes (+{margin:,} margin), {free:,} bytes are free"
        )


def fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, records: list[FileRecord], extra: dict | None = None) -> None:
    """Written last: its presence is what makes a directory a checkpoint."""
    data = {"format": MANIFEST_FORMAT, **(extra or {}), "files": [r.__dict__ for r in records]}
    tmp = directory / (MANIFEST_NAME + ".partial")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)
    fsync_dir(directory)


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise SlimtuneError(f"{directory}: no {MANIFEST_NAME}; not a complete slimtune checkpoint")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SlimtuneError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != MANIFEST_FORMAT:
        raise SlimtuneError(f"{path}: format {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    return data


def is_complete_checkpoint(directory: Path) -> bool:
    try:
        read_manifest(directory)
        return True
    except SlimtuneError:
        return False


def sha256_file(path: Path, block: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty temporary sibling of ``target``; on normal exit it replaces ``target``.
    On any exception the temporary directory is removed and ``target`` is untouched."""
    target = Path(target)
    parent = target.parent
    if target.exists() and not overwrite:
        raise SlimtuneError(f"{target} already exists; pass overwrite to replace it")
    if target.exists() and not target.is_dir():
        raise SlimtuneError(f"{target} exists and is not a directory")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if target.exists():
            if _exchange(tmp, target):
                old = tmp  # tmp now holds the previous checkpoint
            else:
                old = parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(target, old)
                os.rename(tmp, target)
            fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
            fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
