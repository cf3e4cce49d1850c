"""Disk writing apart from any format: a pipelined writer thread (``pipelined_write``), writeback as a
file is written (``WriteBack``), appends past the page cache (``DirectAppend``, O_DIRECT) and the
page-cache advice a reader gives (``drop_cached``, ``read_ahead``). The safetensors checkpoint writer
(``checkpoint/writer.py``) and the GGUF export (``gguf/export.py``) write through these; small files
written whole are ``fileio.py``.

Example::

    with open(path, "r+b") as f:
        out = DirectAppend(path, f.fileno(), start)
        pipelined_write(out, chunks, DEFAULT_INFLIGHT_BYTES)
        end = out.close()
        os.fsync(f.fileno())
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.errors import SlimtuneError
from slimtune.memory import HeapTrim
from slimtune.profiler import in_context, stage
from slimtune.tensors import tensor_bytes

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024  # output bytes per chunk; fp32 temporaries make the peak ~8x this
DEFAULT_INFLIGHT_BYTES = 16 * 1024 * 1024  # finished chunks waiting for the writer: two suffice to overlap


def can_advise() -> bool:
    """Whether the platform takes page-cache advice (posix_fadvise: Linux); elsewhere reads and writes go as usual."""
    return hasattr(os, "posix_fadvise")


def drop_cached(fd: int, offset: int, nbytes: int) -> None:
    """Let go of the page cache's clean pages of bytes [offset, offset + nbytes) of ``fd`` (whole pages
    inside the range only) and start the writeback of its dirty ones (POSIX_FADV_DONTNEED).
    Example: ``drop_cached(f.fileno(), 0, 1 << 20)``"""
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def read_ahead(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start reading bytes [offset, offset + nbytes) of ``fd`` and return at once
    (POSIX_FADV_WILLNEED). Example: ``read_ahead(f.fileno(), end, 64 << 20)``"""
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)


def pipelined_write(writer, chunks: Iterator[torch.Tensor], inflight_bytes: int, bar: tqdm | None = None) -> None:
    """Compute chunk i+1 while a writer thread writes (and hashes) chunk i. Torch ops, file writes and
    sha256 all release the GIL, so production and I/O overlap; at most ``inflight_bytes`` of finished
    chunks wait at any time (one chunk always may, however large)."""
    pending: queue.Queue[torch.Tensor | None] = queue.Queue()
    budget = threading.Condition()
    state = {"inflight": 0, "error": None}

    def consume() -> None:
        while (chunk := pending.get()) is not None:
            nbytes = chunk.numel() * chunk.element_size()
            try:
                if state["error"] is None:
                    writer.write(chunk)
                    if bar is not None:
                        bar.update(nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the producer, which raises it
                state["error"] = e
            finally:
                del chunk
                with budget:
                    state["inflight"] -= nbytes
                    budget.notify()

    thread = threading.Thread(target=in_context(consume), name="slimtune-writer", daemon=True)
    thread.start()
    trim = HeapTrim()  # chunks freed by the writer thread stay in glibc's heaps unless given back
    since_trim = 0  # bytes handed over since trim() last looked at the RSS (a read of /proc/self/status)
    try:
        for chunk in chunks:
            nbytes = chunk.numel() * chunk.element_size()
            with budget:
                budget.wait_for(
                    lambda n=nbytes: state["error"] is not None or state["inflight"] == 0 or state["inflight"] + n <= inflight_bytes
                )
                if state["error"] is not None:
                    break
                state["inflight"] += nbytes
            pending.put(chunk)
            del chunk
            since_trim += nbytes
            if since_trim >= _TRIM_EVERY_BYTES:
                since_trim = 0
                trim()
    finally:
        pending.put(None)
        thread.join()
    if state["error"] is not None:
        raise state["error"]


_TRIM_EVERY_BYTES = 16 * 1024 * 1024
"""How often ``pipelined_write`` asks ``HeapTrim`` (a read of /proc/self/status: per chunk, a GGUF
export's small pieces spent a quarter of its producer's time there), far below its 64 MB slack."""
_WRITEBACK_BYTES = 32 * 1024 * 1024
_DROP_LAG = 256 * 1024 * 1024  # behind the writeback's start: the disk has written it by then


class WriteBack:
    """A file being written front to back that nothing reads back: every ``_WRITEBACK_BYTES`` its bytes
    written up to that much earlier are handed to the kernel's writeback and let go from the page cache
    (posix_fadvise DONTNEED), so the disk writes while the command works and the final fsync has little
    left to wait for (otherwise nothing is written before the kernel's dirty threshold, then writers are
    throttled). DONTNEED starts the writeback of dirty pages but drops only clean ones, so each range is
    advised again ``_DROP_LAG`` bytes later, once the disk has written it: then its pages go at once
    instead of being found by the kernel's page reclaim. Example: ``wb = WriteBack(fd); ...;
    wb.written(end_offset)`` after each write."""

    def __init__(self, fd: int):
        self.fd = fd
        self.released = 0  # bytes [0, released) of the file were handed to writeback
        self.dropped = 0  # and [0, dropped) advised again, to be let go

    def written(self, end: int) -> None:
        """Bytes up to ``end`` are written."""
        if not can_advise():  # elsewhere the fsync does it all
            return
        upto = end - _WRITEBACK_BYTES
        if upto - self.released >= _WRITEBACK_BYTES:
            drop_cached(self.fd, self.released, upto - self.released)
            self.released = upto
        drop = self.released - _DROP_LAG
        if drop - self.dropped >= _WRITEBACK_BYTES:
            drop_cached(self.fd, self.dropped, drop - self.dropped)
            self.dropped = drop


_DIRECT_ALIGN = 4096  # O_DIRECT's offsets, lengths and buffer addresses: a page covers any logical block size up to it
_DIRECT_BUFFER = 8 * 1024 * 1024


def _open_direct(path: Path) -> int | None:
    """A write descriptor of ``path`` that bypasses the page cache (O_DIRECT), or None where the platform
    or the filesystem has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:  # EINVAL: a filesystem without O_DIRECT
        return None


def _read_exactly(path: Path, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)  # the writer's descriptor may be open for writing only
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise SlimtuneError(f"{path}: read {len(data)} of the {nbytes} bytes at offset {offset}")
    return data


def _pwrite_direct(fd: int, data: memoryview, offset: int) -> None:
    pwrite_all(fd, data, offset)


class DirectAppend:
    """Appends bytes to the file ``path`` (open as ``fd``, holding bytes [0, ``start``) already) from
    ``start`` on, bypassing the page cache (O_DIRECT): the bytes are copied into a page-aligned buffer
    (the file's block holding ``start`` read back first, so its head is rewritten as it is) and written
    a whole buffer at a time by a thread of its own, while the caller fills the other of two buffers (so
    the disk never waits for the copy); the last partial block goes through ``fd`` at ``close()``. A
    buffered write of the same bytes spends system CPU on the page cache, its reclaim and writeback; this
    way almost none (the figures: docs/benchmarks.md). Where the platform or filesystem refuses O_DIRECT
    (at open or at a write), every byte from there on goes through ``fd`` (``WriteBack``): the same bytes
    either way. Profiler stages: ``copy`` (into the buffers, waiting for a free one) and ``write`` (the
    disk's). The caller fsyncs. Example: ``w = DirectAppend(path, fd, f.tell()); w.write(view); ...; end = w.close()``"""

    def __init__(self, path: Path, fd: int, start: int, buffer_bytes: int = _DIRECT_BUFFER):
        self.fd, self.pos = fd, start
        self._dfd = _open_direct(path)
        self.direct = self._dfd is not None
        self._refused = False  # a direct write was refused (EINVAL): the writes from there on go through fd
        self._writeback = None if self.direct else WriteBack(fd)
        self._base = start // _DIRECT_ALIGN * _DIRECT_ALIGN  # the file offset of the current buffer's first byte
        size = max(_DIRECT_ALIGN, buffer_bytes // _DIRECT_ALIGN * _DIRECT_ALIGN)
        self._bufs = [_aligned(size) for _ in range(2 if self.direct else 0)]
        self._views = [memoryview(b.numpy()) for b in self._bufs]
        self._pending: list[Future | None] = [None] * len(self._bufs)  # each buffer's write in flight
        self._io = ThreadPoolExecutor(1, thread_name_prefix="slimtune-direct-write") if self.direct else None
        self._cur = 0
        self._fill = start - self._base if self.direct else 0  # bytes in the current buffer
        if self._fill:
            try:
                self._views[0][: self._fill] = _read_exactly(path, self._base, self._fill)
            except BaseException:
                self.abandon()
                raise

    def write(self, data: torch.Tensor) -> None:
        """Append ``data`` (a contiguous tensor's bytes)."""
        flat = data.reshape(-1).view(torch.uint8)
        done, n = 0, flat.numel()
        while done < n and self.direct:
            buf = self._bufs[self._cur]
            take = min(n - done, buf.numel() - self._fill)
            with stage("copy", device_work=False):
                buf[self._fill : self._fill + take].copy_(flat[done : done + take])  # torch's copy: no GIL held
            self._fill += take
            done += take
            if self._fill == buf.numel():
                self._flush(self._fill)
        if done < n:  # no O_DIRECT (from the start, or since the flush above: the buffer is empty)
            pwrite_all(self.fd, tensor_bytes(flat[done:]), self.pos + done)
            self._writeback.written(self.pos + n)
        self.pos += n

    def _flush(self, nbytes: int) -> None:
        """Current buffer bytes [0, nbytes) (whole blocks) to the file at ``_base``, by the writing thread;
        the rest moves to the front of the other buffer, which becomes the current one once its own
        write has finished."""
        cur, other = self._cur, 1 - self._cur
        self._pending[cur] = self._io.submit(in_context(self._write_block), self._views[cur][:nbytes], self._base)
        with stage("copy", device_work=False):
            self._wait(other)
            rest = self._fill - nbytes
            if rest:
                self._views[other][:rest] = self._views[cur][nbytes : self._fill]
        self._base += nbytes
        self._fill, self._cur = rest, other
        if self._refused:
            self._stop_direct()

    def _write_block(self, view: memoryview, offset: int) -> None:
        with stage("write", device_work=False):
            if not self._refused:
                try:
                    _pwrite_direct(self._dfd, view, offset)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._refused = True  # a filesystem that took the flag at open and refuses the write
            pwrite_all(self.fd, view, offset)

    def _wait(self, i: int) -> None:
        job, self._pending[i] = self._pending[i], None
        if job is not None:
            job.result()

    def _wait_all(self) -> None:
        for i in range(len(self._pending)):
            self._wait(i)

    def _stop_direct(self) -> None:
        self._wait_all()
        self._close_direct()
        self.direct = False
        self._writeback = WriteBack(self.fd)

    def close(self) -> int:
        """The buffered bytes written (whole blocks directly, the tail through ``fd``); returns the end offset."""
        try:
            if self.direct and self._fill:
                whole = self._fill // _DIRECT_ALIGN * _DIRECT_ALIGN
                if whole:
                    self._flush(whole)
            self._wait_all()
            if self._fill:
                pwrite_all(self.fd, self._views[self._cur][: self._fill], self._base)
                self._base, self._fill = self._base + self._fill, 0
        finally:
            self.abandon()
        return self.pos

    def abandon(self) -> None:
        """Let go of the O_DIRECT descriptor and the buffers once no write is in flight, writing nothing
        more (the file is being discarded)."""
        for i, job in enumerate(self._pending):
            if job is not None:
                self._pending[i] = None
                job.exception()  # waited for; an error of a file being discarded is moot
        self._close_direct()
        for view in self._views:
            view.release()
        self._views, self._bufs = [], []

    def _close_direct(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None


def _aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised memory at a page-aligned address (as O_DIRECT needs)."""
    raw = torch.empty(nbytes + _DIRECT_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` of ``fd`` (``os.pwrite`` may write less than asked). Example: ``pwrite_all(fd, view, 0)``"""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
