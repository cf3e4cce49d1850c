"""Small files written whole or not at all, and directory fsync: the helpers every writer of small
files shares (manifest, metrics, loss curve, datasets, demo links).

Example: ``write_atomic(Path("out/metrics.jsonl"), "".join(lines))``"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


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
