"""Measurement helpers shared by the peer scripts (stdlib only: each peer runs in its own venv).

The same counters bench/ uses: VmRSS/VmHWM from /proc/self/status (VmHWM reset by writing 5 to
/proc/self/clear_refs), wchar from /proc/self/io, and the disk's sequential write speed with fsync
(16 MiB blocks of random bytes, at most 2 GiB), as ``bench.common.disk_write_mb_s`` measures it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def status_kb(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    return status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    return status_kb("VmHWM") / 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def io_counter(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/io has no {field}")


def disk_write_mb_s(directory: Path, nbytes: int, block: int = 16 * 1024 * 1024) -> float:
    path = Path(directory) / ".peers-disk-probe"
    buf = os.urandom(block)
    start = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(buf)
            written += block
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return written / seconds / 1e6


def fsync_tree(root: Path) -> float:
    """fsync every file under root (what an atomic save does before it returns); returns the seconds."""
    start = time.perf_counter()
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - start


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


class RssSampler:
    """Samples RssAnon and RssFile every ``interval`` s in a thread: which part of the peak is anonymous
    memory and which is file pages (mmap'd files count in VmRSS/VmHWM as RssFile). Torch ops release
    the GIL, so the thread keeps sampling during them; a sample may still miss a short spike."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.max_anon_kb = 0
        self.max_file_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_anon_kb = max(self.max_anon_kb, status_kb("RssAnon"))
            self.max_file_kb = max(self.max_file_kb, status_kb("RssFile") + status_kb("RssShmem"))
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
