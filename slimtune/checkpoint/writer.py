"""Consumes tensor streams into safetensors files by a plan (``plan.py``): the coordinator creates each
file with its header at its final size, then every rank writes its rows of every tensor straight at
their offsets, in row chunks, from the producer to the file. One process is the world of size 1 of
the same mechanism."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.checkpoint.plan import SavePlan, TensorSlot, plan_files
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.formats.manifest import FileRecord, sha256_bytes, sha256_file
from slimtune.formats.safetensors import tensor_bytes
from slimtune.memory import DEFAULT_SHARD_SIZE, HeapTrim, parse_size
from slimtune.profiler import in_context, stage
from slimtune.tensors import DTYPES, StreamTensor, row_chunks

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024  # output bytes per chunk; fp32 temporaries make the peak ~8x this
DEFAULT_INFLIGHT_BYTES = 16 * 1024 * 1024  # finished chunks waiting for the writer: two suffice to overlap


@dataclass(frozen=True)
class WriteOptions:
    """How a checkpoint is written: the one bundle from the config or command line to the writer; every
    save, merge and export takes one of these.

    Example: ``WriteOptions(max_shard_size="2GB", overwrite=True, progress=False, dtype="bf16")``."""

    max_shard_size: str | int = DEFAULT_SHARD_SIZE
    """Largest merged shard; decimal units as Hugging Face uses ("5GB" = 5e9 bytes)."""
    overwrite: bool = False
    """Replace an existing directory (atomically, once the new checkpoint is complete)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Output bytes made per chunk (at least one row)."""
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    """Finished chunks that may wait for the writer thread."""
    progress: bool = True
    """A progress bar on the coordinator."""
    dtype: str | torch.dtype | None = None
    """The merged model's dtype ("bf16", "fp16", "fp32" or a torch dtype); None: the base checkpoint's."""
    adapter_only: bool = False
    """Write the adapter only (a live model's save): no merged model."""
    device: str = "cpu"
    """Where the merge math of each chunk runs (the offline merge: "cpu" or "cuda")."""

    @cached_property
    def shard_bytes(self) -> int:
        """``max_shard_size`` in bytes, parsed once; a bad size is one ``SlimtuneError`` line."""
        try:
            return parse_size(self.max_shard_size)
        except ValueError as e:
            raise SlimtuneError(f"max shard size: {e}") from None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch dtype (None: the base's); an unknown name is one ``SlimtuneError`` line."""
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise SlimtuneError(f"dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
            return DTYPES[self.dtype]
        return self.dtype


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
            trim()
    finally:
        pending.put(None)
        thread.join()
    if state["error"] is not None:
        raise state["error"]


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
        if not hasattr(os, "posix_fadvise"):  # Linux; elsewhere the fsync does it all
            return
        upto = end - _WRITEBACK_BYTES
        if upto - self.released >= _WRITEBACK_BYTES:
            os.posix_fadvise(self.fd, self.released, upto - self.released, os.POSIX_FADV_DONTNEED)
            self.released = upto
        drop = self.released - _DROP_LAG
        if drop - self.dropped >= _WRITEBACK_BYTES:
            os.posix_fadvise(self.fd, self.dropped, drop - self.dropped, os.POSIX_FADV_DONTNEED)
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
    _pwrite_all(fd, data, offset)


class DirectAppend:
    """Appends bytes to the file ``path`` (open as ``fd``, holding bytes [0, ``start``) already) from
    ``start`` on, bypassing the page cache (O_DIRECT): the bytes are copied into a page-aligned buffer
    (the file's block holding ``start`` read back first, so its head is rewritten as it is) and written
    a whole buffer at a time; the last partial block goes through ``fd`` at ``close()``. A buffered
    write of the same bytes costs ~1.5-2.5 s of system CPU per GB here (page cache, reclaim, writeback)
    and ~0.05 this way. Where the platform or filesystem refuses O_DIRECT (at open or at the first
    write), every byte goes through ``fd`` (``WriteBack``): the same bytes either way. The caller
    fsyncs. Example: ``w = DirectAppend(path, fd, f.tell()); w.write(view); ...; end = w.close()``"""

    def __init__(self, path: Path, fd: int, start: int, buffer_bytes: int = _DIRECT_BUFFER):
        self.fd, self.pos = fd, start
        self._dfd = _open_direct(path)
        self.direct = self._dfd is not None
        self._writeback = None if self.direct else WriteBack(fd)
        self._base = start // _DIRECT_ALIGN * _DIRECT_ALIGN  # the file offset of the buffer's first byte
        size = max(_DIRECT_ALIGN, buffer_bytes // _DIRECT_ALIGN * _DIRECT_ALIGN)
        raw = torch.empty(size + _DIRECT_ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % _DIRECT_ALIGN
        self._buf = raw[skip : skip + size]
        self._view = memoryview(self._buf.numpy())
        self._fill = start - self._base
        if self.direct and self._fill:
            try:
                self._view[: self._fill] = _read_exactly(path, self._base, self._fill)
            except BaseException:
                self.abandon()
                raise

    def write(self, data: torch.Tensor) -> None:
        """Append ``data`` (a contiguous tensor's bytes)."""
        flat = data.reshape(-1).view(torch.uint8)
        done, n = 0, flat.numel()
        while done < n and self.direct:
            take = min(n - done, self._buf.numel() - self._fill)
            self._buf[self._fill : self._fill + take].copy_(flat[done : done + take])  # torch's copy: no GIL held
            self._fill += take
            done += take
            if self._fill == self._buf.numel():
                self._flush(self._fill)
        if done < n:  # no O_DIRECT (from the start, or since the flush above: the buffer is empty)
            _pwrite_all(self.fd, tensor_bytes(flat[done:]), self.pos + done)
            self._writeback.written(self.pos + n)
        self.pos += n

    def _flush(self, nbytes: int) -> None:
        """Buffer bytes [0, nbytes) (whole blocks) to the file at ``_base``; the rest moves to the front."""
        view = self._view[:nbytes]
        if self.direct:
            try:
                _pwrite_direct(self._dfd, view, self._base)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct()  # a filesystem that took the flag at open and refuses the write
        if not self.direct:
            _pwrite_all(self.fd, view, self._base)
        rest = self._fill - nbytes
        if rest:
            self._view[:rest] = self._view[nbytes : self._fill]
        self._base += nbytes
        self._fill = rest

    def _stop_direct(self) -> None:
        os.close(self._dfd)
        self._dfd, self.direct = None, False
        self._writeback = WriteBack(self.fd)

    def close(self) -> int:
        """The buffered bytes written (whole blocks directly, the tail through ``fd``); returns the end offset."""
        try:
            if self.direct and self._fill:
                whole = self._fill // _DIRECT_ALIGN * _DIRECT_ALIGN
                if whole:
                    self._flush(whole)
                if self._fill:
                    _pwrite_all(self.fd, self._view[: self._fill], self._base)
                    self._base, self._fill = self._base + self._fill, 0
        finally:
            self.abandon()
        return self.pos

    def abandon(self) -> None:
        """Let go of the O_DIRECT descriptor and the buffer, writing nothing more (the file is being discarded)."""
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        self._view.release()


class _RowSink:
    """Takes one rank's chunks of one file in plan order and writes each at its offset with pwrite
    (hashing them too when this rank writes the whole file, so that file needs no read back). Each
    finished tensor is reported to ``done(global_slot)`` (the progress other ranks' hashers follow).
    A file hashed here is never read back: its written bytes go to the kernel's writeback as the save
    works (``WriteBack``). The hash of a chunk runs on a thread of the sink's own while the chunk is
    written (both release the GIL), and the chunk is let go only when both are done, so the hash stays
    in order; ``close`` ends that thread (before the fsync: the process holds no idle thread there)."""

    def __init__(self, fd: int, path: Path, slots: list[tuple[int, TensorSlot, int, int]], sha=None, done=None):
        self.fd, self.path, self.sha, self.done_fn = fd, path, sha, done
        self.pieces = [(g, s, s.offset + a * s.row_bytes, (b - a) * s.row_bytes) for g, s, a, b in slots if b > a]
        self.index, self.done = 0, 0
        self.writeback = WriteBack(fd) if sha is not None else None
        self._hasher = None if sha is None else ThreadPoolExecutor(1, thread_name_prefix="slimtune-hash")

    def write(self, chunk: torch.Tensor) -> None:
        if self.index >= len(self.pieces):
            raise SlimtuneError(f"{self.path}: more data than the plan gives this rank")
        g, slot, offset, nbytes = self.pieces[self.index]
        if chunk.dtype != slot.dtype:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: got {chunk.dtype}, the header says {slot.dtype}")
        data = tensor_bytes(chunk)
        if self.done + len(data) > nbytes:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: more bytes than its rows {list(slot.shape)}")
        hashed = None if self._hasher is None else self._hasher.submit(in_context(self._hash), data)
        try:
            with stage("write", device_work=False):
                _pwrite_all(self.fd, data, offset + self.done)
                if self.writeback is not None:
                    self.writeback.written(offset + self.done + len(data))
        finally:
            if hashed is not None:
                hashed.result()  # before the next chunk, and before this one is let go
        self.done += len(data)
        if self.done == nbytes:
            self.index, self.done = self.index + 1, 0
            if self.done_fn is not None:
                self.done_fn(g)

    def _hash(self, data: memoryview) -> None:
        with stage("hash", device_work=False):
            self.sha.update(data)

    def close(self) -> None:
        """End the hash thread (the hash so far is kept)."""
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def check_complete(self) -> None:
        if self.index < len(self.pieces):
            raise SlimtuneError(f"{self.path}: tensor {self.pieces[self.index][1].name}: the stream ended before its rows were written")


class _Progress:
    """How far each rank has written, for hashers that trail the writers on one host: rank r keeps, in
    a small file of the temporary directory, the global index (over all files' tensors in plan order)
    of the first tensor it still has rows to write; every tensor below the minimum over ranks is
    complete in the page cache and can be read back and hashed while the ranks write on."""

    NAME = ".slimtune-progress-{}"

    def __init__(self, directory: Path, plan: SavePlan, rank: int):
        self.slots = [(fi, s) for fi, f in enumerate(plan.files) for s in f.slots]
        self.mine = [g for g, (_, s) in enumerate(self.slots) if s.ranges[rank][1] > s.ranges[rank][0]]
        self.directory, self.world_size = directory, plan.world_size
        self.fd = os.open(directory / self.NAME.format(rank), os.O_RDWR | os.O_CREAT, 0o644)
        self.publish(self.mine[0] if self.mine else len(self.slots))
        self.peers: list[int] = []

    def publish(self, value: int) -> None:
        _pwrite_all(self.fd, memoryview(struct.pack("<q", value)), 0)

    def finished(self, g: int) -> None:
        """Tensor ``g`` done: publish the next one this rank writes rows of."""
        later = [m for m in self.mine if m > g]
        self.publish(later[0] if later else len(self.slots))

    def open_peers(self) -> None:
        self.peers = [os.open(self.directory / self.NAME.format(r), os.O_RDONLY) for r in range(self.world_size)]

    def complete_below(self) -> int:
        return min(struct.unpack("<q", os.pread(fd, 8, 0))[0] for fd in self.peers)

    def close(self) -> None:
        for fd in [self.fd, *self.peers]:
            os.close(fd)


def _trailing_hash(directory: Path, plan: SavePlan, files: list[int], progress: _Progress, stop: threading.Event, hashes, errors) -> None:
    """Hash ``files`` (indices) in order, each tensor as soon as every rank has written it."""
    buf = bytearray(8 * 1024 * 1024)
    view = memoryview(buf)
    try:
        g0 = {fi: next(g for g, (f, _) in enumerate(progress.slots) if f == fi) for fi in files if plan.files[fi].slots}
        for fi in files:
            f = plan.files[fi]
            h = hashlib.sha256(f.header)
            fd = os.open(directory / f.path, os.O_RDONLY)
            try:
                for k, slot in enumerate(f.slots):
                    while progress.complete_below() <= g0[fi] + k:
                        if stop.wait(0.02):
                            return
                    pos, end = slot.offset, slot.offset + slot.nbytes
                    while pos < end:
                        n = os.preadv(fd, [view[: min(len(buf), end - pos)]], pos)
                        if n <= 0:
                            raise SlimtuneError(f"{directory / f.path}: short read at byte {pos} while hashing")
                        h.update(view[:n])
                        pos += n
            finally:
                os.close(fd)
            hashes[f.path] = h.hexdigest()
    except BaseException as e:  # noqa: BLE001 - reported at the next status exchange
        errors.append(e)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def create_files(directory: Path, plan: SavePlan) -> None:
    """The coordinator's part before anyone writes: every file with its header, at its final size
    (the tensor bytes are a hole until the ranks fill them, so nothing is written twice)."""
    for f in plan.files:
        path = directory / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def write_planned(directory: Path, plan: SavePlan, ranks: Ranks, options: WriteOptions, bar: tqdm | None = None) -> list[FileRecord]:
    """Every rank's part: its rows of every tensor, file by file, straight at their offsets; fsync; then
    one status exchange per file (a failed rank stops every rank there). A file written whole by one
    rank is hashed as it is written. Any other file is read back once by its planned hasher rank, in a
    thread: on one host it trails the writers tensor by tensor (``_Progress``: the bytes are still in
    the page cache); across hosts it starts after every rank's fsync of the file. Returns every file's
    record, on every rank."""
    rank = ranks.rank
    hashes: dict[str, str] = {}
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()
    mine = [i for i, h in enumerate(plan.hashers) if h == rank]
    read_back = [i for i in mine if plan.files[i].sole_writer(plan.world_size) != rank]
    trailing = ranks.world_size > 1 and len(set(ranks.gather(socket.gethostname(), "planning the hashes"))) == 1
    progress = None

    def after_fsync(path: str) -> None:
        try:
            with stage("hash", device_work=False):
                hashes[path] = sha256_file(directory / path)
        except BaseException as e:  # noqa: BLE001 - reported at the next status exchange
            errors.append(e)

    try:
        if trailing:
            error = None
            try:
                progress = _Progress(directory, plan, rank)
            except Exception as e:  # noqa: BLE001
                error = e
            ranks.agree(error, "starting the hashers")
            progress.open_peers()
            if read_back:
                args = (directory, plan, read_back, progress, stop, hashes, errors)
                threads.append(threading.Thread(target=_trailing_hash, args=args, name="slimtune-hash", daemon=True))
                threads[-1].start()
        for i, (f, hasher) in enumerate(zip(plan.files, plan.hashers, strict=True)):
            error = None
            try:
                _write_file_part(directory, plan, i, rank, hasher == rank and i not in read_back, options, bar, hashes, progress)
            except Exception as e:  # noqa: BLE001 - every rank learns of it at the exchange below
                error = e
            ranks.agree(error, f"writing {f.path}")
            if not trailing and i in read_back:
                threads.append(threading.Thread(target=in_context(after_fsync), args=(f.path,), name="slimtune-hash", daemon=True))
                threads[-1].start()
    except BaseException:
        stop.set()
        raise
    finally:
        for t in threads:
            t.join()
        if progress is not None:
            progress.close()
    ranks.agree(errors[0] if errors else None, "hashing the files")
    for part in ranks.gather(hashes, "collecting the hashes"):
        hashes.update(part)
    if trailing and ranks.is_coordinator:  # every hasher has finished: the progress files go
        for r in range(ranks.world_size):
            (directory / _Progress.NAME.format(r)).unlink(missing_ok=True)
    return [FileRecord(f.path, f.size, hashes[f.path]) for f in plan.files]


def _write_file_part(
    directory: Path,
    plan: SavePlan,
    index: int,
    rank: int,
    hash_now: bool,
    options: WriteOptions,
    bar: tqdm | None,
    hashes: dict[str, str],
    progress: _Progress | None,
) -> None:
    f = plan.files[index]
    first = sum(len(p.slots) for p in plan.files[:index])  # global index of the file's first tensor
    mine = [(first + k, s, *s.ranges[rank]) for k, s in enumerate(f.slots)]
    if not f.bytes_of(rank) and not hash_now:
        return
    path = directory / f.path
    fd = os.open(path, os.O_WRONLY)
    try:
        sink = _RowSink(fd, path, mine, hashlib.sha256(f.header) if hash_now else None, progress.finished if progress else None)
        try:
            chunks = (c for _, s, a, b in mine for c in row_chunks(s.source, options.chunk_bytes, a, b))
            pipelined_write(sink, chunks, options.inflight_bytes, bar)
        finally:
            sink.close()
        sink.check_complete()
        with stage("fsync", device_work=False):
            os.fsync(fd)
    finally:
        os.close(fd)
    if sink.sha is not None:
        hashes[f.path] = sink.sha.hexdigest()


def write_safetensors(path: Path, tensors: list[StreamTensor], options: WriteOptions = WriteOptions()) -> FileRecord:
    """One safetensors file from stream entries, by the planned writer (one process); returns its record."""
    plan = plan_files([(path.name, tensors)])
    create_files(path.parent, plan)
    return write_planned(path.parent, plan, SINGLE, options)[0]


def write_json(path: Path, data: object) -> FileRecord:
    """A small JSON file written and fsynced; returns its record."""
    raw = (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(path.name, len(raw), sha256_bytes(raw))
