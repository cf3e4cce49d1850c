"""Small files written whole or not at all, directory fsync, free disk space and one-line OS errors: the
helpers every writer of files shares (manifest, metrics, loss curve, datasets, demo links, the GGUF
file, the Modelfile; checkpoint directories are ``checkpoint/atomic.py``).

Example: ``write_atomic(Path("out/metrics.jsonl"), "".join(lines))``"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slimtune.errors import SlimtuneError


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op off POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str | Callable[[Path], None], suffix: str = ".partial", sync: bool = False) -> None:
    """Write ``path`` through a temporary sibling ``path + suffix`` renamed over it: readers see the old
    file or the new one, never a part. ``data`` is bytes, text (UTF-8) or ``write(tmp)`` for writers that
    want a path (matplotlib). With ``sync`` the file and its directory are fsynced. On failure the
    temporary is removed and the error (an ``OSError``) propagates; ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (the file system's or the process's file-size limit, ulimit -f)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a directory about to be made will live)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None


def check_free_space(directory: Path, needed: int, margin: int = 16 * 1024 * 1024) -> None:
    """Refuse before writing ``needed`` bytes under ``directory`` (which need not exist yet) without room."""
    free = free_bytes(directory)
    if free is not None and free < needed + margin:
        raise SlimtuneError(
            f"not enough disk space in {existing_ancestor(directory)}: the checkpoint needs {needed:,} bytes (+{margin:,} margin), "
            f"{free:,} bytes are free"
        )


def describe_os_error(e: OSError, what: str, where: Path, needed: int | None = None) -> str:
    """One line for a failed write: ``cannot write /x/step-000002: no space left on device (needs ..., ... free)``."""
    reason = _REASONS.get(e.errno, e.strerror or str(e))
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and needed is not None:
        free = free_bytes(where)
        reason += f" (needs {needed:,} bytes, {free:,} are free)" if free is not None else f" (needs {needed:,} bytes)"
    detail = f" [{e.filename}]" if e.filename and Path(str(e.filename)) != Path(where) else ""
    return f"cannot {what} {where}: {reason}{detail}"


@contextmanager
def os_errors(what: str, where: Path, needed: int | None = None) -> Iterator[None]:
    """Turn an ``OSError`` inside the block into one ``SlimtuneError`` line (see ``describe_os_error``).

    Example: ``with os_errors("write", path): path.write_text(text)``"""
    try:
        yield
    except OSError as e:
        raise SlimtuneError(describe_os_error(e, what, Path(where), needed)) from None


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yields the path of a temporary sibling of the file ``target`` to write; on normal exit it is fsynced
    and renamed over ``target``. On any exception it is removed and ``target`` is untouched (never a
    partial file under the final name). An ``OSError`` is one ``SlimtuneError`` line.

    Example: ``with atomic_file(Path("out/Modelfile")) as tmp: tmp.write_text("FROM ./model.gguf\\n")``"""
    target = Path(target)
    if target.is_dir():
        raise SlimtuneError(f"{target} is a directory; expected a file path")
    tmp = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        with os_errors("write", target):
            target.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            fsync_dir(target.parent)
    finally:
        with contextlib.suppress(OSError):  # gone (renamed), or its directory never was
            tmp.unlink(missing_ok=True)
