"""Forked worker processes that quantize pieces of blocks out of shared memory (``slimtune.gguf.ggml``'s
``Quantizer`` runs on them).

Why processes: the quantizers are hundreds of small torch ops a piece. Each op releases the GIL for its
kernel and takes it back after, so two quantizer threads in one process hand the GIL to each other
hundreds of times a piece and wait at every handoff, so two threads gain little over one; two processes
share nothing but the cores and their cache (figures: docs/benchmarks.md, "GGUF quantizers").

How it works, all on Linux's ``fork`` (no pickling, no imports in the child; elsewhere the caller quantizes
in its own thread): the pool maps ``slots`` pairs of shared anonymous buffers (rows in, bytes out) and forks
``workers`` processes that inherit them. ``submit`` copies rows into a free slot and puts one small task
per piece on a shared queue; any idle worker takes the next one, runs ``work(name, piece, finite)`` on
one torch thread (GNU OpenMP's pool does not survive a fork: one thread never enters it) and writes the
piece's bytes at their planned offset in the slot's out buffer. The returned function waits for the
submission's pieces and copies its bytes out, which frees the slot. A worker's exception comes back as
its type and message; a worker that dies (killed: out of memory) is an error naming it, never a hang.
Workers end with the pool (a ``None`` task each), or with their parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch

from slimtune.errors import SlimtuneError

_PR_SET_PDEATHSIG = 1
Work = Callable[[str, torch.Tensor, bool], torch.Tensor]


def can_fork() -> bool:
    """True where the pool can run: Linux, whose ``fork`` start method it needs."""
    return hasattr(os, "fork") and os.uname().sysname == "Linux"


@dataclass
class _Submission:
    order: int  # its first task's id: the oldest is finished first when every slot is busy
    slot: int
    tasks: int  # pieces still out
    sizes: list[int]  # each piece's bytes, in order, at consecutive offsets of the out buffer
    error: tuple[str, str] | None = None
    data: list[torch.Tensor] | None = field(default=None, repr=False)


class PiecePool:
    """``workers`` forked processes running ``work`` on pieces (see the module docstring). Use it in a
    ``with`` block; ``slot_bytes`` bounds one submission's rows (bigger ones go in several).

    Example::

        with PiecePool(lambda name, piece, finite: piece.sum(1), 2) as pool:
            parts = pool.submit(torch.ones(4, 8), [(0, 2), (2, 4)], "sum", [8, 8], False)()
    """

    def __init__(self, work: Work, workers: int, slot_bytes: int = 16 * 1024 * 1024, slots: int = 3):
        self.work, self.workers, self.slot_bytes, self.slots = work, max(1, workers), slot_bytes, slots
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._results: list[Connection] = []
        self._pending: dict[int, tuple[_Submission, int]] = {}  # task id -> (its submission, piece index)
        self._busy: list[_Submission | None] = [None] * slots
        self._next_task = 0

    def __enter__(self) -> PiecePool:
        context = multiprocessing.get_context("fork")
        self._in = [mmap.mmap(-1, self.slot_bytes) for _ in range(self.slots)]
        self._out = [mmap.mmap(-1, self.slot_bytes) for _ in range(self.slots)]
        self._tasks = context.SimpleQueue()
        gc.freeze()  # the parent's objects out of the collector's reach: a child's collection would copy their pages
        try:
            for i in range(self.workers):
                reader, writer = context.Pipe(duplex=False)
                proc = context.Process(target=self._serve, args=(writer,), name=f"slimtune-quant-{i}", daemon=True)
                proc.start()
                writer.close()
                self._procs.append(proc)
                self._results.append(reader)
        except BaseException:
            self._stop(kill=True)
            raise
        finally:
            gc.unfreeze()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop(kill=exc_type is not None)

    def _stop(self, kill: bool) -> None:
        if not kill:
            for _ in self._procs:
                self._tasks.put(None)
        for proc in self._procs:
            if kill:
                proc.kill()
            proc.join(timeout=None if not kill else 5)
        for conn in self._results:
            conn.close()
        self._procs, self._results = [], []

    # --- the worker's side ---------------------------------------------------------------------------

    def _serve(self, results: Connection) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the pool
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:
            return
        torch.set_num_threads(1)
        while (task := self._tasks.get()) is not None:
            task_id, name, dtype, slot, start, shape, offset, finite = task
            try:
                count = shape[0] * shape[1]
                rows = torch.frombuffer(self._in[slot], dtype=dtype, count=count, offset=start).view(shape)
                data = self.work(name, rows, finite).reshape(-1).view(torch.uint8)
                out = torch.frombuffer(self._out[slot], dtype=torch.uint8, count=data.numel(), offset=offset)
                out.copy_(data)
                results.send((task_id, None))
            except Exception as e:  # noqa: BLE001 - the parent raises it
                results.send((task_id, (type(e).__name__, str(e))))

    # --- the parent's side ---------------------------------------------------------------------------

    def submit(self, rows: torch.Tensor, pieces: list[tuple[int, int]], name: str, sizes: list[int], finite: bool):
        """Start ``work(name, rows[a:b], finite)`` for each piece ``(a, b)`` of the 2-D ``rows`` (at most
        ``slot_bytes``), whose results are ``sizes`` bytes each. Returns a function that waits and gives
        the pieces' bytes as flat uint8 tensors, in order, or raises what a piece raised."""
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self.slot_bytes or sum(sizes) > self.slot_bytes:
            raise ValueError(f"{nbytes:,} bytes of rows (out {sum(sizes):,}) do not fit a slot of {self.slot_bytes:,}")
        slot = self._free_slot()
        rows = rows.contiguous()
        torch.frombuffer(self._in[slot], dtype=rows.dtype, count=rows.numel()).view(rows.shape).copy_(rows)
        sub = _Submission(self._next_task, slot, len(pieces), list(sizes))
        self._busy[slot] = sub
        row_bytes = rows.shape[1] * rows.element_size()
        offset = 0
        for index, ((a, b), size) in enumerate(zip(pieces, sizes, strict=True)):
            self._pending[self._next_task] = (sub, index)
            self._tasks.put((self._next_task, name, rows.dtype, slot, a * row_bytes, (b - a, rows.shape[1]), offset, finite))
            self._next_task += 1
            offset += size
        return lambda: self._finish(sub)

    def _free_slot(self) -> int:
        while True:
            for i, sub in enumerate(self._busy):
                if sub is None:
                    return i
            self._finish(min((s for s in self._busy if s is not None), key=lambda s: s.order))  # its data kept for its caller

    def _finish(self, sub: _Submission) -> list[torch.Tensor]:
        while sub.data is None:
            if sub.tasks:
                self._receive()
                continue
            if self._busy[sub.slot] is sub:
                self._busy[sub.slot] = None
            if sub.error is not None:
                sub.data = []
            else:
                out = torch.frombuffer(self._out[sub.slot], dtype=torch.uint8, count=sum(sub.sizes)).clone()
                sub.data = list(out.split(sub.sizes))
        if sub.error is not None:
            raise _rebuilt(*sub.error)
        return sub.data

    def _receive(self) -> None:
        ready = wait(self._results + [p.sentinel for p in self._procs])
        for conn in ready:
            if isinstance(conn, Connection):
                try:
                    task_id, error = conn.recv()
                except EOFError:
                    continue  # its worker ended: its sentinel says how
                sub, _ = self._pending.pop(task_id)
                sub.tasks -= 1
                if error is not None and sub.error is None:
                    sub.error = error
        for proc in self._procs:
            if proc.exitcode is not None and self._pending:
                code = proc.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                raise SlimtuneError(f"quantizer process {proc.pid} ended ({how}{'; out of memory?' if code == -9 else ''})")


_ERRORS: dict[str, type[Exception]] = {"FloatingPointError": FloatingPointError, "ValueError": ValueError}


def register_error(cls: type[Exception]) -> type[Exception]:
    """Let a worker's ``cls`` come back as itself (others come back as ``RuntimeError``)."""
    _ERRORS[cls.__name__] = cls
    return cls


def _rebuilt(name: str, message: str) -> Exception:
    cls = _ERRORS.get(name)
    return cls(message) if cls is not None else RuntimeError(f"{name}: {message}")
