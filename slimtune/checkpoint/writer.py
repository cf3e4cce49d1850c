"""Consumes tensor streams into safetensors files by a plan (``plan.py``): the coordinator creates each
file with its header at its final size, then every rank writes its rows of every tensor straight at
their offsets, in row chunks, from the producer to the file. One process is the world of size 1 of
the same mechanism."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.checkpoint.plan import SavePlan, TensorSlot, plan_files
from slimtune.diskio import DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES, DirectAppend, pipelined_write, pwrite_all
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.formats.manifest import FileRecord, FileTap, hash_lanes, sha256_bytes, sha256_file
from slimtune.memory import DEFAULT_SHARD_SIZE, parse_size
from slimtune.profiler import in_context, stage
from slimtune.tensors import DTYPES, StreamTensor, row_chunks, tensor_bytes


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


class _RowSink:
    """Takes one rank's chunks of one file in plan order and writes each at its offset with pwrite.
    Each finished tensor is reported to ``done(global_slot)`` (the progress other ranks' hashers follow).
    A file this rank writes whole and hashes (``tap``) is written front to back past the page cache
    (``DirectAppend``: nothing reads it back) and hashed from the chunks themselves, on the tap's
    thread, while the writer goes on."""

    def __init__(self, fd: int, path: Path, slots: list[tuple[int, TensorSlot, int, int]], tap: FileTap | None = None, done=None):
        self.fd, self.path, self.tap, self.done_fn = fd, path, tap, done
        self.pieces = [(g, s, s.offset + a * s.row_bytes, (b - a) * s.row_bytes) for g, s, a, b in slots if b > a]
        self.index, self.done = 0, 0
        self.direct = None if tap is None or not self.pieces else DirectAppend(path, fd, self.pieces[0][2])

    def write(self, chunk: torch.Tensor) -> None:
        if self.index >= len(self.pieces):
            raise SlimtuneError(f"{self.path}: more data than the plan gives this rank")
        g, slot, offset, nbytes = self.pieces[self.index]
        if chunk.dtype != slot.dtype:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: got {chunk.dtype}, the header says {slot.dtype}")
        data = tensor_bytes(chunk)
        at = offset + self.done
        if self.done + len(data) > nbytes:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: more bytes than its rows {list(slot.shape)}")
        if self.direct is not None and at != self.direct.pos:
            raise SlimtuneError(f"{self.path}: tensor {slot.name}: bytes at {at}, the file is written up to {self.direct.pos}")
        if self.direct is not None:
            self.direct.write(chunk)  # timed by it: "copy" here, "write" on its thread
        else:
            with stage("write", device_work=False):
                pwrite_all(self.fd, data, at)
        if self.tap is not None:
            self.tap.seen(at, chunk)  # the tap holds the chunk (a pooled buffer) until it is hashed
        self.done += len(data)
        if self.done == nbytes:
            self.index, self.done = self.index + 1, 0
            if self.done_fn is not None:
                self.done_fn(g)

    def close(self) -> None:
        """Every piece written: the direct writer's tail goes through ``fd``."""
        if self.index < len(self.pieces):
            raise SlimtuneError(f"{self.path}: tensor {self.pieces[self.index][1].name}: the stream ended before its rows were written")
        if self.direct is not None:
            self.direct.close()
            self.direct = None

    def abandon(self) -> None:
        if self.direct is not None:
            self.direct.abandon()
            self.direct = None


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
        pwrite_all(self.fd, memoryview(struct.pack("<q", value)), 0)

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


def _trailing_hash(directory: Path, plan: SavePlan, fi: int, progress: _Progress, stop: threading.Event) -> str:
    """The sha256 of file ``fi`` (an index), each tensor read back as soon as every rank has written it."""
    buf = bytearray(8 * 1024 * 1024)
    view = memoryview(buf)
    f = plan.files[fi]
    g0 = next((g for g, (i, _) in enumerate(progress.slots) if i == fi), 0)
    h = hashlib.sha256(f.header)
    fd = os.open(directory / f.path, os.O_RDONLY)
    try:
        for k, slot in enumerate(f.slots):
            while progress.complete_below() <= g0 + k:
                if stop.wait(0.02):
                    raise SlimtuneError(f"{directory / f.path}: the save stopped before the file was hashed")
            pos, end = slot.offset, slot.offset + slot.nbytes
            while pos < end:
                n = os.preadv(fd, [view[: min(len(buf), end - pos)]], pos)
                if n <= 0:
                    raise SlimtuneError(f"{directory / f.path}: short read at byte {pos} while hashing")
                with stage("hash", device_work=False):
                    h.update(view[:n])
                pos += n
    finally:
        os.close(fd)
    return h.hexdigest()


def create_files(directory: Path, plan: SavePlan) -> None:
    """The coordinator's part before anyone writes: every file with its header, at its final size
    (the tensor bytes are a hole until the ranks fill them, so nothing is written twice)."""
    for f in plan.files:
        path = directory / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


FILE_LANES = 2
"""Files one process writes at once from streams that allow it (``write_planned``'s ``file_lanes``): one
sha256 per file runs on one core, so a save whose disk writes faster than a core hashes is paced by
the hash unless two files are hashed at once. Each lane gets 1/``FILE_LANES`` of the chunk and in-flight
bytes, so the lanes' producers together hold what one would."""


def write_planned(
    directory: Path, plan: SavePlan, ranks: Ranks, options: WriteOptions, bar: tqdm | None = None, file_lanes: int = 1
) -> list[FileRecord]:
    """Every rank's part: its rows of every tensor, file by file, straight at their offsets; fsync; then
    one status exchange per file (a failed rank stops every rank there). A file written whole by one
    rank is hashed from the chunks as they are written, by a thread that trails the writer (``FileTap``)
    while the writer goes on with the next file. Any other file is read back once by its planned hasher rank, in a
    thread: on one host it trails the writers tensor by tensor (``_Progress``: the bytes are still in
    the page cache); across hosts it starts after every rank's fsync of the file. Either way the files
    are hashed ``hash_lanes`` at a time, each a plain sha256. One process with ``file_lanes`` > 1 (streams
    that make any file's rows from any thread) writes that many files at once (``_write_in_lanes``).
    Returns every file's record, on every rank."""
    lanes = min(file_lanes, hash_lanes(len(plan.files)))
    if ranks.world_size == 1 and lanes > 1:
        return _write_in_lanes(directory, plan, options, bar, lanes)
    rank = ranks.rank
    hashes: dict[str, str] = {}
    errors: list[BaseException] = []
    stop = threading.Event()
    mine = [i for i, h in enumerate(plan.hashers) if h == rank]
    read_back = [i for i in mine if plan.files[i].sole_writer(plan.world_size) != rank]
    trailing = ranks.world_size > 1 and len(set(ranks.gather(socket.gethostname(), "planning the hashes"))) == 1
    lanes = hash_lanes(len(mine))
    pool = ThreadPoolExecutor(lanes, thread_name_prefix="slimtune-hash")
    pending: dict[str, object] = {}  # path -> the Future of its sha256
    live: list[tuple[str, FileTap]] = []  # files hashed as written, not finished yet
    progress = None
    sizes = {f.path: f.size for f in plan.files}

    def settle(path: str, job) -> None:
        try:
            hashes[path] = job.hexdigest(sizes[path]) if isinstance(job, FileTap) else job.result()
        except BaseException as e:  # noqa: BLE001 - reported at the next status exchange
            errors.append(e)

    def read_whole(path: str) -> str:
        with stage("hash", device_work=False):
            return sha256_file(directory / path)

    try:
        if trailing:
            error = None
            try:
                progress = _Progress(directory, plan, rank)
            except Exception as e:  # noqa: BLE001
                error = e
            ranks.agree(error, "starting the hashers")
            progress.open_peers()
            for i in read_back:
                pending[plan.files[i].path] = pool.submit(in_context(_trailing_hash), directory, plan, i, progress, stop)
        for i, (f, hasher) in enumerate(zip(plan.files, plan.hashers, strict=True)):
            error = None
            hash_now = hasher == rank and i not in read_back
            while hash_now and len(live) >= lanes:  # at most ``lanes`` hash threads at once
                settle(*live.pop(0))
            try:
                tap = _write_file_part(directory, plan, i, rank, hash_now, options, bar, progress)
                if tap is not None:
                    live.append((f.path, tap))
            except Exception as e:  # noqa: BLE001 - every rank learns of it at the exchange below
                error = e
            ranks.agree(error, f"writing {f.path}")
            if not trailing and i in read_back:
                pending[f.path] = pool.submit(in_context(read_whole), f.path)
    except BaseException:
        stop.set()  # a live tap's thread ends by itself once idle
        raise
    finally:
        pool.shutdown(wait=True)
        if progress is not None:
            progress.close()
    for path, job in [*live, *pending.items()]:
        settle(path, job)
    ranks.agree(errors[0] if errors else None, "hashing the files")
    for part in ranks.gather(hashes, "collecting the hashes"):
        hashes.update(part)
    if trailing and ranks.is_coordinator:  # every hasher has finished: the progress files go
        for r in range(ranks.world_size):
            (directory / _Progress.NAME.format(r)).unlink(missing_ok=True)
    return [FileRecord(f.path, f.size, hashes[f.path]) for f in plan.files]


def _write_in_lanes(directory: Path, plan: SavePlan, options: WriteOptions, bar: tqdm | None, lanes: int) -> list[FileRecord]:
    """One process's files, ``lanes`` at a time, each written and hashed by a lane of its own with
    1/``lanes`` of the chunk and in-flight bytes. The first failure stops the other lanes at their next
    chunk and is raised once every lane has stopped."""
    lane_options = replace(options, chunk_bytes=max(1, options.chunk_bytes // lanes), inflight_bytes=options.inflight_bytes // lanes)
    stop = threading.Event()

    def one(i: int) -> str:
        if stop.is_set():
            raise _Stopped
        try:
            tap = _write_file_part(directory, plan, i, 0, True, lane_options, bar, None, stop)
            return tap.hexdigest(plan.files[i].size)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(lanes, thread_name_prefix="slimtune-file") as pool:
        jobs = [pool.submit(in_context(one), i) for i in range(len(plan.files))]
        errors = [e for e in (job.exception() for job in jobs) if e is not None and not isinstance(e, _Stopped)]
    if errors:
        raise errors[0]
    return [FileRecord(f.path, f.size, job.result()) for f, job in zip(plan.files, jobs, strict=True)]


class _Stopped(Exception):
    """A lane stopped because another lane's file failed (that failure is the one raised)."""


def _stoppable(chunks: Iterator[torch.Tensor], stop: threading.Event | None) -> Iterator[torch.Tensor]:
    for chunk in chunks:
        if stop is not None and stop.is_set():
            raise _Stopped
        yield chunk


def _write_file_part(
    directory: Path,
    plan: SavePlan,
    index: int,
    rank: int,
    hash_now: bool,
    options: WriteOptions,
    bar: tqdm | None,
    progress: _Progress | None,
    stop: threading.Event | None = None,
) -> FileTap | None:
    """This rank's rows of file ``index``, fsynced; with ``hash_now`` (this rank writes it whole), the
    ``FileTap`` that hashes it, maybe still hashing its last chunks (None otherwise)."""
    f = plan.files[index]
    first = sum(len(p.slots) for p in plan.files[:index])  # global index of the file's first tensor
    mine = [(first + k, s, *s.ranges[rank]) for k, s in enumerate(f.slots)]
    if not f.bytes_of(rank) and not hash_now:
        return None
    path = directory / f.path
    fd = os.open(path, os.O_WRONLY)
    tap = FileTap(path, "hash") if hash_now else None
    sink = None
    try:
        if tap is not None:
            tap.seen(0, memoryview(f.header))
        sink = _RowSink(fd, path, mine, tap, progress.finished if progress else None)
        chunks = (c for _, s, a, b in mine for c in row_chunks(s.source, options.chunk_bytes, a, b))
        pipelined_write(sink, _stoppable(chunks, stop), options.inflight_bytes, bar)
        sink.close()
        with stage("fsync", device_work=False):
            os.fsync(fd)
    except BaseException:
        if sink is not None:
            sink.abandon()
        raise
    finally:
        os.close(fd)
    return tap


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
