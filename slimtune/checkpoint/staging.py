"""Reusable chunk buffers. Chunks read from files or copied off a GPU land in a fixed pool of buffers
instead of fresh allocations: host memory is bounded by the pool (not by how the allocator fragments),
and nothing is allocated per chunk. A buffer returns to the pool when the last tensor viewing it is
dropped, i.e. once the writer thread has written it; a producer that runs ahead waits for one."""

from __future__ import annotations

import queue
import threading
import weakref

import torch

from slimtune.formats.manifest import TAP_HOLDS
from slimtune.profiler import stage


def to_host(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The plain path: a contiguous CPU tensor in ``dtype`` (no copy when it already is one)."""
    with stage("device_to_host"):
        return x.to(device="cpu", dtype=dtype).contiguous()


class BufferPool:
    """``count`` buffers of ``buffer_bytes`` (pinned for fast, asynchronous device-to-host copies)."""

    def __init__(self, buffer_bytes: int, count: int, pin_memory: bool = False):
        self.buffer_bytes, self.pin_memory = buffer_bytes, pin_memory
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        self.unallocated = count  # buffers are made on first need: a pool nobody draws on costs nothing
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor backed by a pooled buffer (a fresh one if it is larger)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.buffer_bytes:
            return torch.empty(shape, dtype=dtype)
        buffer = self._get()
        view = buffer[:nbytes].view(dtype).view(shape)
        weakref.finalize(view, self.free.put, buffer)
        return view

    def _get(self) -> torch.Tensor:
        try:
            return self.free.get_nowait()
        except queue.Empty:
            with self._lock:
                make = self.unallocated > 0
                self.unallocated -= make
            if make:
                return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            return self.free.get()

    def to_host(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A finished chunk as the writer wants it: CPU, contiguous, ``dtype``. A CPU tensor that already
        is one (a view of a parameter) passes as it is; anything else is cast or copied into a pooled
        buffer (a GPU chunk by asynchronous DMA into pinned memory, then one wait)."""
        if not x.is_cuda and x.dtype == dtype and x.is_contiguous():
            return x
        chunk = self.take(tuple(x.shape), dtype)
        with stage("device_to_host"):
            chunk.copy_(x, non_blocking=x.is_cuda)  # copy_ casts with the same rounding as .to(dtype)
            if x.is_cuda:
                torch.cuda.current_stream(x.device).synchronize()
        return chunk


def pool_for(chunk_bytes: int, inflight_bytes: int, pin_memory: bool = False) -> BufferPool:
    """Enough buffers for every chunk the writer may hold, the one it writes, the one being made and
    those its file's hash still holds (``TAP_HOLDS``: the writer hashes the chunks it writes)."""
    return BufferPool(chunk_bytes, inflight_bytes // chunk_bytes + 3 + TAP_HOLDS, pin_memory)
