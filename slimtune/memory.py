"""Process memory and I/O counters read from /proc, the figures every bound in slimtune is stated in."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import TypeVar

_MB = 1024 * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_mb() -> float:
    """Current resident set size (VmRSS) in MiB."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """Peak resident set size since start or the last reset (VmHWM) in MiB."""
    return _status_kb("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def private_mb(pid: int | str = "self") -> float:
    """Memory this process (or process ``pid``) holds that no other process shares (Private_Clean +
    Private_Dirty of /proc/PID/smaps_rollup) in MiB: for a forked process, its own allocations plus the
    pages its parent has written since the fork (copy-on-write leaves the old page to the child). 0.0 where
    unsupported or where the process has ended."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:"))) / 1024
    except OSError:
        return 0.0


def _io_counter(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/io has no {field}")


def bytes_written_by_process() -> int:
    """Bytes this process has passed to write() calls (wchar in /proc/self/io)."""
    return _io_counter("wchar")


def bytes_read_by_process() -> int:
    """Bytes this process has read through read() calls (rchar in /proc/self/io)."""
    return _io_counter("rchar")


T = TypeVar("T")


class PeakMemory:
    """Peak RSS of a whole run, and of each save on its own (VmHWM is reset around a save, so the run's
    peak is carried across the reset). Peak GPU memory where the run's device is a GPU.

    Example::

        memory = PeakMemory(device)
        result, rss_before, save_peak = memory.around_save(lambda: manager.save(...))
        memory.snapshot()   # {"peak_rss_mb": ..., "peak_gpu_mb": ... on CUDA}
    """

    def __init__(self, device) -> None:
        self.device = device  # a torch.device (only its type is read here: no torch import for the CLI)
        self.run_peak = peak_rss_mb()

    def around_save(self, save: Callable[[], T]) -> tuple[T, float, float]:
        """``save()``'s result, the RSS before it and the peak RSS during it."""
        self.run_peak = max(self.run_peak, peak_rss_mb())
        before = rss_mb()
        reset_peak_rss()
        result = save()
        save_peak = peak_rss_mb()
        self.run_peak = max(self.run_peak, save_peak)
        return result, before, save_peak

    def snapshot(self) -> dict:
        """The run's peak RSS so far (and peak GPU memory on CUDA), in MiB."""
        figures = {"peak_rss_mb": max(self.run_peak, peak_rss_mb())}
        if self.device.type == "cuda":
            import torch  # only on a GPU: the CLI imports this module before torch

            figures["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return figures


REFAULT_S_PER_MB = 0.5e-3
"""System time to fault a megabyte of given-back memory in again (first touch: the kernel maps and zeroes
the pages), a little under this constant where it was measured (docs/benchmarks.md, "Training step")."""


class HeapTrim:
    """Hands the memory glibc keeps after ``free`` back to the system once the process has grown by
    ``slack_mb`` since this object last did (or was made). glibc returns freed heap memory only from the
    top of its heaps; what a CPU training step frees in between (each micro-batch's activations and
    temporaries, of sizes that change with its rows) stays resident and the next micro-batch's
    allocations, of other sizes, grow the heap again: a 2-layer Llama-3-8B step of 12 short rows grew
    the RSS by 342 MB of which 20 MB were live tensors, and ``malloc_trim`` gave 232 MB back. One read of
    /proc/self/status per call, and ``malloc_trim(0)`` only past the slack. A no-op off glibc.

    What is given back is faulted in again by the next allocations that need it (``REFAULT_S_PER_MB``).
    ``cost_share`` bounds that cost: a trim waits until the time since the last one is at least the
    re-fault cost of what it would give back divided by ``cost_share`` (0.02: at most ~2% of the time).
    A step of minutes (an 8B model on a CPU) still trims after every micro-batch; a step of a fraction of
    a second keeps its working set between steps instead of faulting it in again each time (SmolLM2:
    every step trimmed, ~0.1 s of a 0.7 s step, before). None: no time rule.

    Example::

        trim = HeapTrim(cost_share=0.02)   # kept across steps
        for batch in micro_batches:
            loss(batch).backward()
            trim()   # True when it gave memory back
    """

    def __init__(self, slack_mb: float = 64.0, cost_share: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.slack_mb, self.cost_share, self.clock = slack_mb, cost_share, clock
        self._trim = _malloc_trim()
        self.low = rss_mb() if self._trim is not None else 0.0
        self.since = clock()

    def __call__(self) -> bool:
        if self._trim is None:
            return False
        grown = rss_mb() - self.low
        if grown < self.slack_mb:
            return False
        if self.cost_share is not None and self.clock() - self.since < grown * REFAULT_S_PER_MB / self.cost_share:
            return False
        self._trim(0)
        self.low = rss_mb()
        self.since = self.clock()
        return True


_MALLOC_TRIM: list = []


def _malloc_trim():
    """glibc's ``malloc_trim`` through ctypes (looked up once), or None where the C library has none."""
    if not _MALLOC_TRIM:
        try:
            import ctypes

            trim = ctypes.CDLL(None).malloc_trim
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            trim = None
        _MALLOC_TRIM.append(trim)
    return _MALLOC_TRIM[0]


DEFAULT_SHARD_SIZE = "5GB"  # the largest merged shard unless the config or command line says otherwise


def parse_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000 (decimal units, as Hugging Face shards), '512MiB' -> binary units. A
    positive, finite size of at most 2**63 bytes; anything else ('abc', 'nanGB', '1e400GB', '-1GB')
    raises ValueError."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"cannot read size {size!r}: expected a number with an optional unit like '5GB'")
    if isinstance(size, int):
        value = size
    else:
        text = size.strip().upper()
        units = {"KIB": 1024, "MIB": _MB, "GIB": 1024**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
        factor, number = 1, text
        for unit, f in units.items():
            if text.endswith(unit):
                factor, number = f, text[: -len(unit)].strip()
                break
        if not _SIZE_NUMBER.fullmatch(number):
            raise ValueError(f"cannot read size {size!r}: expected a number with an optional unit like '5GB'")
        x = float(number) * factor
        if not math.isfinite(x):
            raise ValueError(f"size {size!r} is not a finite number of bytes")
        value = int(x)
    if not 0 < value <= 2**63:
        raise ValueError(f"size {size!r}: expected a positive number of bytes (at most 2**63)")
    return value


_SIZE_NUMBER = re.compile(r"[0-9]{1,30}(\.[0-9]{0,30})?([eE][+-]?[0-9]{1,3})?")
