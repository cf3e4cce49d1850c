"""slimtune's small C loops (``quant/nf4_kernel.c``, ``gguf/kquant_kernel.c``): each built once with the
machine's C compiler and loaded with ctypes; torch's code runs wherever one cannot be.

Built with ``$CC`` (else ``cc``, ``gcc``, ``clang`` on PATH) into ``$XDG_CACHE_HOME/slimtune`` (else
``~/.cache/slimtune``), named by the hash of the source, the compiler, the flags and the machine, written
to a temporary sibling and renamed: a second process reuses it, two building at once each rename a whole
file. ``SLIMTUNE_NATIVE=0`` turns every loop off. ``load`` gives the library or a one-line reason why not
(``slimtune --version`` prints each loop's line).

Example::

    lib, why = load(Path("kquant_kernel.c"), ("-O2", "-ffp-contract=off"))   # (CDLL, "") or (None, reason)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

__all__ = ["load", "once"]

_SHARED = ("-shared", "-fPIC")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "slimtune"


def _build(source: Path, cc: str, flags: tuple[str, ...]) -> Path:
    """The library for this source, compiler and flags: from the cache, else compiled into it (temporary
    sibling, rename). Raises OSError or CalledProcessError (its first stderr line) on failure."""
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, cc.encode(), " ".join(flags).encode(), platform.machine().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *_SHARED, "-o", tmp, str(source)], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, flags: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str]:
    """``source`` built with ``flags`` (plus ``-shared -fPIC``) and loaded: (the library, ""), or (None,
    why not: ``SLIMTUNE_NATIVE=0``, no compiler, the compiler's first error line, a load failure)."""
    if os.environ.get("SLIMTUNE_NATIVE", "1") == "0":
        return None, "SLIMTUNE_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler: set CC or install cc"
    try:
        return ctypes.CDLL(str(_build(source, cc, flags))), ""
    except subprocess.CalledProcessError as e:
        first = (e.stderr or "").strip().splitlines()
        return None, f"{cc} failed: {first[0] if first else f'exit {e.returncode}'}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"the C loop could not be built or loaded: {e}"


def once(loader: Callable[[], T]) -> Callable[[], T]:
    """``loader`` called at most once per process, on the first call of the result, under a lock (a pool's
    threads may ask at the same time); later calls return its value.

    Example: ``_library = once(lambda: load(SOURCE, FLAGS))``"""
    lock, box = threading.Lock(), []

    def get() -> T:
        if not box:
            with lock:
                if not box:
                    box.append(loader())
        return box[0]

    return get
