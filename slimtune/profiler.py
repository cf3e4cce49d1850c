"""Seconds per stage of a save (dequantize, merge, device_to_host, write, hash, fsync), for the benches.

Off unless ``timing_stages()`` is active in the current context (a ``contextvars`` variable, so two
saves timed in different threads or tasks keep their own figures; a thread the save starts runs in a
copy of its context, ``in_context``). Then ``stage(name)`` adds up wall time per name; the producer
stages and the writer thread's stages overlap, so their sum exceeds the save's seconds. With
``cuda_sync`` the device is synchronised at each producer stage's edges so GPU work lands in its own
stage: that removes the overlap of GPU work with the host and slows the save, so the benches time a
save from a GPU once plainly (the figure) and once more with stages (the breakdown).

Example::

    with timing_stages(cuda_sync=True) as profile:
        save_checkpoint(model, out)
    profile.seconds  # {"dequantize": 3.1, "merge": 1.2, "device_to_host": 4.0, "hash": 6.5, "write": 9.8}"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class StageProfile:
    """Seconds per stage name, added to from any thread (locked): ``seconds`` sums every thread's time in
    the stage; ``wall()`` is the wall time during which at least one thread was in it (two threads hashing
    at once for 1 s: 2 s summed, 1 s of wall), the share of the run the stage can have set the pace of."""

    def __init__(self, cuda_sync: bool):
        self.cuda_sync = cuda_sync
        self.seconds: dict[str, float] = {}
        self._spans: dict[str, list[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float) -> None:
        """Stage ``name`` ran from ``start`` to ``end`` (``time.perf_counter()`` seconds) on one thread."""
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + end - start
            self._spans.setdefault(name, []).append((start, end))

    def wall(self) -> dict[str, float]:
        """Per stage, the length of the union of its threads' spans."""
        covered = {}
        with self._lock:
            spans = {name: sorted(s) for name, s in self._spans.items()}
        for name, ordered in spans.items():
            total, reach = 0.0, float("-inf")
            for start, end in ordered:
                total += max(0.0, end - max(start, reach))
                reach = max(reach, end)
            covered[name] = total
        return covered


_current: contextvars.ContextVar[StageProfile | None] = contextvars.ContextVar("slimtune_stage_profile", default=None)


@contextmanager
def stage(name: str, device_work: bool = True) -> Iterator[None]:
    """Time the block as stage ``name`` when a profile is active in this context (synchronising the GPU
    around it if the profile asks and ``device_work``); nothing otherwise.

    Example: ``with stage("write", device_work=False): os.pwrite(fd, data, offset)``"""
    profile = _current.get()
    if profile is None:
        yield
        return
    sync = profile.cuda_sync and device_work
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        profile.add(name, start, time.perf_counter())


@contextmanager
def timing_stages(cuda_sync: bool = False) -> Iterator[StageProfile]:
    """Collect per-stage seconds for the saves run inside the block, in this context (and the threads
    they start through ``in_context``); an enclosing profile is restored after it."""
    profile = StageProfile(cuda_sync)
    token = _current.set(profile)
    try:
        yield profile
    finally:
        _current.reset(token)


def in_context(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` bound to a copy of the current context: the target of a thread whose stages count toward
    the profile of the code that starts it (threads start in an empty context otherwise).

    Example: ``threading.Thread(target=in_context(consume)).start()``"""
    return functools.partial(contextvars.copy_context().run, fn)
