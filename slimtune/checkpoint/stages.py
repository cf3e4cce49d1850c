"""Seconds per stage of a save (dequantize, merge, device_to_host, write, hash, fsync), for the benches.

Off unless ``timing_stages()`` is active (then ``stage(name)`` adds up wall time per name; the producer
stages and the writer thread's stages overlap, so their sum exceeds the save's seconds). With
``cuda_sync`` the device is synchronised at each producer stage's edges so GPU work lands in its own
stage: that removes the overlap of GPU work with the host and slows the save, so the benches time a
save from a GPU once plainly (the figure) and once more with stages (the breakdown).

Example::

    with timing_stages(cuda_sync=True) as clock:
        save_checkpoint(model, out)
    clock.seconds  # {"dequantize": 3.1, "merge": 1.2, "device_to_host": 4.0, "hash": 6.5, "write": 9.8}"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageClock:
    def __init__(self, cuda_sync: bool):
        self.cuda_sync = cuda_sync
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds


_active: StageClock | None = None


@contextmanager
def stage(name: str, device_work: bool = True) -> Iterator[None]:
    """Time the block as stage ``name`` when a clock is active (synchronising the GPU around it if the
    clock asks and ``device_work``); nothing otherwise."""
    clock = _active
    if clock is None:
        yield
        return
    sync = clock.cuda_sync and device_work
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        clock.add(name, time.perf_counter() - start)


@contextmanager
def timing_stages(cuda_sync: bool = False) -> Iterator[StageClock]:
    """Collect per-stage seconds for the saves run inside the block (one process-wide clock)."""
    global _active
    clock = StageClock(cuda_sync)
    _active = clock
    try:
        yield clock
    finally:
        _active = None
