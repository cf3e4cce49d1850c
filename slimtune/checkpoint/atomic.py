"""Checkpoint directories that appear whole or not at all: written in a temporary sibling, fsynced,
completed by a manifest (files, sizes, sha256), then renamed into place. An earlier checkpoint at the
same path is swapped out only after the new one is complete.

The temporary sibling ``.NAME.tmp-XXXXXXXX`` has a lock file beside it (``...tmp-XXXXXXXX.lock``,
created and flock-ed before the directory exists, removed after it is gone), held by the writing
process for as long as it lives: the next write into the same parent removes the temporaries of
killed processes (lock free) and never those of a live one. Single files (``atomic_file``), free
space and one-line OS errors are ``fileio.py``'s."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimtune.distributed import sigterm_deferred
from slimtune.errors import SlimtuneError
from slimtune.fileio import fsync_dir
from slimtune.formats.manifest import (  # noqa: F401 - re-exported: the checkpoint's manifest, as callers know it from here
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    FileRecord,
    read_manifest,
    sha256_file,
    write_manifest,
)

log = logging.getLogger(__name__)


_TEMP = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{8}$")
_OLD = re.compile(r"^\.(.+)\.old-[0-9a-f]{8}$")


def is_complete_checkpoint(directory: Path) -> bool:
    try:
        read_manifest(directory)
        return True
    except SlimtuneError:
        return False


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


def reclaim_leftovers(parent: Path, lockless: bool = False) -> list[str]:
    """Remove the temporary directories that killed processes left in ``parent`` (their lock is free);
    a live writer's lock keeps its own. Ones without a lock file (left by a version without locks, or
    not slimtune's) go only with ``lockless`` (a run directory, where that name is slimtune's).
    Returns the names removed (each also logged at DEBUG; a run directory's owner reports them).

    Example: ``removed = reclaim_leftovers(Path("out"), lockless=True)``"""
    removed = []
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return removed
    for path in entries:
        if _TEMP.match(path.name) and path.is_dir():
            lock = _lock_path(path)
            fd = _try_lock(lock)
            if fd is False or (fd is None and not lockless):
                continue  # a live process is writing it, or it may not be ours
            log.debug(f"removing {path.name}, left by an interrupted save")
            shutil.rmtree(path, ignore_errors=True)
            _release(lock, fd)
            removed.append(path.name)
        elif path.name.endswith(".lock") and _TEMP.match(path.name[: -len(".lock")]) and not path.with_suffix("").exists():
            fd = _try_lock(path)
            if fd is not False:
                _release(path, fd)
        elif (m := _OLD.match(path.name)) and (path.parent / m.group(1)).is_dir() and path.is_dir():
            log.debug(f"removing {path.name}, left by an interrupted save")  # the swap finished: the previous copy
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def live_temporaries(parent: Path) -> list[str]:
    """The temporary directories in ``parent`` that a live process is writing now (it holds their lock)."""
    live = []
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return live
    for path in entries:
        if _TEMP.match(path.name) and path.is_dir():
            fd = _try_lock(_lock_path(path))
            if fd is False:
                live.append(path.name)
            elif fd is not None:
                os.close(fd)  # free: left by a killed process (reclaim_leftovers removes it)
    return live


def _lock_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")


def _try_lock(lock: Path) -> int | None | bool:
    """The fd of ``lock`` locked by us (None: no lock file), or False while another process holds it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _release(lock: Path, fd: int | None) -> None:
    try:
        lock.unlink(missing_ok=True)
    except OSError:
        pass
    if fd is not None:
        os.close(fd)


def _make_parents(path: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (deepest last), so a failure can take them back."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir(exist_ok=True)
            created.append(d)
    except BaseException:
        _remove_empty(created)
        raise
    return created


def _remove_empty(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


@contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty temporary sibling of ``target``; on normal exit it replaces ``target``.
    On any exception the temporary directory (and any parent directory made for it) is removed and
    ``target`` is untouched. Leftovers of killed writers in the same parent are removed first.

    Example: ``with atomic_directory(Path("out/model")) as tmp: (tmp / "config.json").write_text("{}")``"""
    target = Path(target)
    parent = target.parent
    if target.exists() and not overwrite:
        raise SlimtuneError(f"{target} already exists; pass overwrite to replace it")
    if target.exists() and not target.is_dir():
        raise SlimtuneError(f"{target} exists and is not a directory")
    created = _make_parents(parent)
    reclaim_leftovers(parent)
    tmp = parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    lock = _lock_path(tmp)
    fd = None
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the temporary directory is gone
        tmp.mkdir()
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
        created = []  # they hold the target now
    except BaseException:
        with sigterm_deferred():  # a SIGTERM raised mid-rmtree would leave the temporary directory behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        with sigterm_deferred():
            if fd is not None:
                _release(lock, fd)
            _remove_empty(created)
