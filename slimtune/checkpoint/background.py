"""Zero-stall checkpoints (``checkpoint.async``): at a save point the training loop only snapshots what
changes (adapters, optimizer, scheduler, loss scaler, RNG, data position: ``train_state``, the recipe
state and the small documents) and hands it to a writer, which writes the whole checkpoint through the
one writer (``CheckpointManager.save`` -> ``write_checkpoint``) while training goes on.

Two mechanisms, chosen by where the model lives (the figures behind the choice: docs/benchmarks.md):

- **fork** (a model in host memory, one process, Linux): at each save point the trainer forks a writer
  (``_fork_writer``). Its memory is the trainer's at that instant, copy-on-write: the frozen NF4 model,
  the adapters and the training state's tensors are the snapshot, nothing is copied or rebuilt, and it
  runs the synchronous save itself, on one thread (GNU OpenMP's thread pool does not survive a fork: a
  forked process that computes on several threads hangs), then exits. It runs at nice 19: it takes the CPU training leaves,
  and all of it while training waits for it (a save point during a save, the run's end); a save point
  that finds the previous save still running makes the next writers less nice (10, then 0); a fork that
  fails (no memory or processes left) has the trainer write that save itself. What it holds
  beyond the trainer's pages is its chunks plus the pages the trainer rewrites while it runs
  (``checkpoint_writer_private_mb``).
- **process** (a model on a GPU, or under torchrun): a writer process started with the run rebuilds the
  frozen NF4 model from the base files with the trainer's own ``load_qlora_model`` arguments
  (deterministic: the same bytes), on the CPU, and for each save copies the snapshot's adapters (from
  a GPU through pinned host buffers) into it. Where the base files changed since the run started (size
  or mtime) a save point falls back to the synchronous save, with one log line.

Either way an asynchronous checkpoint is the synchronous one, byte for byte (tested). A thread in the
trainer's process running the rebuilding writer (``SLIMTUNE_ASYNC_WRITER=thread``, as ``process`` and
``fork`` select those) is there for the comparison only.

Under torchrun (FSDP2) every rank starts its own writer, and the writers form a gloo process group of
their own (they are no ranks of the job: they meet at a store the coordinator holds, ``WriterGroup``),
with the job's ranks and world size. Each writer loads the model FSDP2-sharded as its trainer did, so
it holds the same rows; each trainer snapshots its local shards (a DTensor travels as its local shard,
``_Shard``, and is rebuilt on the writers' mesh); the writers then run the synchronous cooperative save
itself among themselves (their rows of the merged shards, their DCP shards of the training state, the
coordinator's small files, manifest and rename). The trainers learn together that a save is over or
failed: while one is in flight, each step exchanges every rank's writer's answer (one small gather), so
every rank finishes it, or raises the same line, at the same step; a trainer waiting for its writer
exchanges every ``_WAIT_POLL_S`` meanwhile. Where one writer failed or died, a writer still at work is
stopped by its trainer (SIGTERM, then SIGKILL) before the coordinator reclaims the temporary directory.
Joining the writers' group fails after ``_JOIN_TIMEOUT`` (every rank then saves synchronously).

Rules: at most one save in flight (a save point reached while the previous save runs waits for it,
and the wait is stall); the run's end waits for the last save; ``keep_last_n`` prunes after a save is
complete. A failure in a writer (a full disk, a read-only file system, a killed writer) is raised
as one ``SlimtuneError`` line at the trainers' next step, after the writers' temporary directory is
gone. A writer dies with the trainer (``PR_SET_PDEATHSIG``: SIGTERM, on which it removes its temporary
directory); a temporary directory left anyway is reclaimed by its lock (``atomic.py``). Writers are
named ``slimtune-ckpt`` (ps, top).

Example::

    saver = BackgroundSaver(WriterSpec(model_dir, lora, seed=0, dtype=torch.bfloat16), manager, say, model=model)
    if saver.available(step):
        stall_s = saver.submit(step, state, options, train_state)   # returns once the snapshot is sent
    saver.annotate(record)        # every step: in-flight flag, a finished save's figures; raises a failure
    saver.close()                 # waits for the last save
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import io
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import SaveOptions
from slimtune.distributed import SINGLE, PeerFailure, Ranks, current_ranks, device_mesh, is_dtensor, raise_on_sigterm, shutdown
from slimtune.errors import SlimtuneError
from slimtune.logs import configure_logging
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, private_mb, reset_peak_rss
from slimtune.model import load_qlora_model
from slimtune.runtime import usable_cores

MECHANISM_ENV = "SLIMTUNE_ASYNC_WRITER"  # "fork", "process" or "thread": for the measurement only
MECHANISMS = ("fork", "process", "thread")
WRITER_NAME = b"slimtune-ckpt"  # the writer's process name (ps, top)
# The forked writer's nice values: it starts at 19 (it takes the CPU training leaves, and all of it while
# training waits for it); each save point that finds the previous save still running moves it one down.
FORKED_WRITER_NICE = (19, 10, 0)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_GROUP_TIMEOUT = datetime.timedelta(seconds=1800)  # the writers' collectives, as the trainers' (init_distributed)
# How long a writer waits for the others to join the writers' group. They start together (the trainers
# start them after one collective) and join once Python and torch are imported (~4 s alone, more on a
# busy host): 120 s is a wide margin, and a writer that cannot join costs its peers 120 s, not 1800 s.
_JOIN_TIMEOUT = datetime.timedelta(seconds=120)
# How long a writer stopped in a save its peer's writer failed has after SIGTERM (removing its temporary
# directory: an rmtree), then after SIGKILL, before the trainers go on without it.
_HALT_S = 30.0
# A trainer waiting for its writer's answer exchanges answers with the other ranks this often meanwhile.
_WAIT_POLL_S = 1.0


@dataclass(frozen=True)
class WriterGroup:
    """Where the writer of a job's rank joins the writers' own gloo process group: the address and port
    of the store the coordinator holds, its rank (the trainer's) and the world size (the job's)."""

    host: str
    port: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class WriterSpec:
    """What the writer rebuilds the frozen model from: the trainer's ``load_qlora_model`` arguments, and
    under a process group the writers' own group (``WriterGroup``, filled in by ``BackgroundSaver``)."""

    model_dir: Path
    lora: LoRAConfig
    seed: int = 0
    dtype: torch.dtype | None = None
    group: WriterGroup | None = None


@dataclass(frozen=True)
class _Shard:
    """A DTensor in a snapshot: this rank's local shard and what rebuilds it on the writers' mesh."""

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple


def base_fingerprint(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file of the base directory: a change means the writer's NF4 model may
    no longer be the trainer's."""
    try:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
    except OSError:
        return {}


@dataclass
class _InFlight:
    step: int
    name: str
    started: float
    step_rates: list[float] = dataclasses.field(default_factory=list)


class BackgroundSaver:
    """The trainer's side of the writer (module docstring). One per run on each rank; under a process
    group (``ranks``) every rank calls each method at the same steps, and the ranks decide together
    when a save is over (or failed)."""

    def __init__(
        self,
        spec: WriterSpec,
        manager: CheckpointManager,
        log: Callable[[str], None],
        mechanism: str | None = None,
        ranks: Ranks = SINGLE,
        model: nn.Module | None = None,
    ):
        self.spec, self.manager, self.log, self.ranks, self.model = spec, manager, log, ranks, model
        self.fingerprint = base_fingerprint(spec.model_dir)
        self.mechanism = _mechanism(mechanism or os.environ.get(MECHANISM_ENV) or "fork", ranks, model)
        self.in_flight: _InFlight | None = None
        self.outcome: tuple | None = None  # this rank's writer's answer for the save in flight
        self.unusable: str | None = None  # why saves are synchronous from now on
        self.ready = False
        self.finished: list[tuple[_InFlight, dict]] = []  # saves finished since the last annotate
        self.outside_rates: list[float] = []  # tokens/s of the steps that ran during no save
        self.busy: _InFlight | None = None  # the save in flight when the current step began
        self.said = False
        self.snapshot_bytes: int | None = None
        self.ready_wait_s = 0.0
        self.nice = FORKED_WRITER_NICE[0]  # the next forked writer's
        self.store, self.conn, self.proc, self.thread = None, None, None, None
        if self.mechanism == "fork":  # a writer forked at each save point: nothing to start
            self.ready = True
            return
        self.store, group = _writer_group(ranks)  # the writers' own process group, through a store on the coordinator
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        if self.mechanism == "thread":
            self.thread = threading.Thread(target=_serve, args=(Connection(theirs.detach()),), name="slimtune-ckpt", daemon=True)
            self.thread.start()
        else:
            self.proc = _start_process(theirs)
        self.conn.send((dataclasses.replace(spec, group=group), manager.out))

    # --- the save point ---------------------------------------------------------------------------

    def available(self, step: int) -> bool:
        """Whether the save at ``step`` can go to the writer: it loaded the same base (waits for it to be
        ready: that wait is stall), and the base files are unchanged since the run started; under a
        process group, on every rank. The first time not, one log line; from then on every save is
        synchronous."""
        rebuilt = self.mechanism != "fork"  # a forked writer shares the trainer's model: no base files read
        if rebuilt and self.unusable is None and base_fingerprint(self.spec.model_dir) != self.fingerprint:
            self.unusable = f"the base files in {self.spec.model_dir} changed since the run started"
        if self.unusable is None and not self.ready:
            started = time.perf_counter()
            message = self._receive(f"starting the checkpoint writer for step-{step:06d}")
            self.ready_wait_s = time.perf_counter() - started  # stall too: submit adds it
            if message[0] == "ready":
                self.ready = True
            else:
                self.unusable = message[1]
        if not self.said and self.ranks.world_size > 1:  # every rank saves the same way
            reasons = self.ranks.gather(self.unusable, f"starting the background save of step-{step:06d}")
            self.unusable = next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None), None)
        if self.unusable is not None and not self.said:
            self.log(f"checkpoint.async: {self.unusable}; saving synchronously from step {step} on")
            self.said = True
            self._stop_writer()
        return self.unusable is None

    def submit(self, step: int, state: dict, options: SaveOptions, train_state: dict) -> float:
        """Wait for the save in flight (if any), snapshot ``train_state`` (the forked writer: the
        trainer's memory itself, copy-on-write; else its tensors copied to host memory: pinned buffers
        from a GPU; of a DTensor, this rank's shard), the recipe state and the small files of
        ``options``, and hand them to the writer. Returns the seconds the caller was blocked (with any
        wait for the writer to be ready in ``available``)."""
        started = time.perf_counter() - self.ready_wait_s
        self.ready_wait_s = 0.0
        if self.in_flight is not None:
            if self.mechanism == "fork" and self.outcome is None and not self.conn.poll():
                self._less_nice(step)  # the previous writer is late: the next one yields less to training
            self._settle(block=True)
        extra = {name: Path(path).read_bytes() for name, path in (options.extra_files or {}).items()}
        request = {"step": step, "state": state, "options": dataclasses.replace(options, extra_files=None), "extra": extra}
        if self.mechanism == "fork":  # the forked process's memory is the snapshot (copy-on-write)
            request["train_state"] = train_state
            self.snapshot_bytes = sum(len(data) for data in extra.values())
            self.in_flight = _InFlight(step, self.manager.step_path(step).name, time.perf_counter())
            try:
                self.proc, self.conn = _fork_writer(self.model, self.manager, request, self.nice)
            except OSError as e:  # no memory or processes left for a fork: this save in the trainer, as a synchronous one
                self.log(f"checkpoint.async: cannot fork the checkpoint writer ({e.strerror}); saving {self.in_flight.name} in the trainer")
                self.outcome = _write(self.model, self.manager, request, SINGLE, own_process=False)
                self._settle(block=True)
            return time.perf_counter() - started
        request["train_state"] = _to_host(train_state)
        buffer = io.BytesIO()
        torch.save(request, buffer)
        del request
        self.snapshot_bytes = buffer.getbuffer().nbytes
        self.in_flight = _InFlight(step, self.manager.step_path(step).name, time.perf_counter())
        try:
            self.conn.send_bytes(buffer.getbuffer())
        except OSError:
            self.outcome = self._writer_lost(f"writing {self.in_flight.name}")  # the ranks learn of it together
        return time.perf_counter() - started

    # --- every step ---------------------------------------------------------------------------------

    def annotate(self, record: dict, last: bool = False) -> None:
        """Fill a step's metrics record: ``checkpoint_in_flight`` (a save ran during the step), and for a
        save that finished, ``checkpoint_saved``, ``checkpoint_save_s`` (its background duration),
        ``checkpoint_bytes``, ``checkpoint_peak_rss_mb`` (the writer's; under a process group the largest
        writer's), ``checkpoint_snapshot_bytes`` (on the save point's step), ``tokens_per_s_during_save`` and
        ``tokens_per_s_outside_save`` (mean throughput of the steps that ran during it, and of the steps
        so far that ran during no save). ``last``: the run ends here; wait for the save in flight
        (``checkpoint_final_wait_s``); where two saves finish in one step, the earlier one's figures go
        to ``checkpoint_also_saved``. Raises the writer's failure as one line (any rank's writer's, on
        every rank at the same step)."""
        busy = self.busy  # the save in flight when this step began
        if record.get("tokens_per_s") is not None:
            (busy.step_rates if busy is not None else self.outside_rates).append(record["tokens_per_s"])
        if self.in_flight is not None:
            self._settle(block=False)
        if last and self.in_flight is not None:
            started = time.perf_counter()
            self._settle(block=True)
            record["checkpoint_final_wait_s"] = time.perf_counter() - started
        record["checkpoint_in_flight"] = busy is not None
        if self.snapshot_bytes is not None:  # this step's save point: the serialized snapshot's size
            record["checkpoint_snapshot_bytes"], self.snapshot_bytes = self.snapshot_bytes, None
        for flight, figures in self.finished:
            if flight.step_rates:
                figures["tokens_per_s_during_save"] = sum(flight.step_rates) / len(flight.step_rates)
            if self.outside_rates:
                figures["tokens_per_s_outside_save"] = sum(self.outside_rates) / len(self.outside_rates)
            if "checkpoint_saved" in record:  # two finished in one step (the last one waited for the one before)
                record.setdefault("checkpoint_also_saved", []).append({k: record[k] for k in figures if k in record})
            record.update(figures)
        self.finished = []
        self.busy = self.in_flight

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer."""
        if self.in_flight is not None:
            self._settle(block=True)
        if not self.said:
            self._stop_writer()

    # --- internals ----------------------------------------------------------------------------------

    def _less_nice(self, step: int) -> None:
        lower = [n for n in FORKED_WRITER_NICE if n < self.nice]
        if lower:
            self.nice = lower[0]
            self.log(f"checkpoint.async: the save before step {step}'s was still running; the next writers run at nice {self.nice}")

    def _settle(self, block: bool) -> None:
        """This rank's writer's answer for the save in flight (with ``block`` waited for, else taken if
        there), exchanged between the ranks: the save is over when every writer answered, and failed
        when any writer did; every rank takes the same decision at the same step. A blocking wait
        exchanges every ``_WAIT_POLL_S`` too, so a rank learns of a peer's failure while its own writer
        still works (and stops it)."""
        what = f"writing {self.in_flight.name}"
        while True:
            if self.outcome is None:
                self.outcome = self._answer(what, _WAIT_POLL_S if block else 0.0)
                if self.outcome is not None and self.mechanism == "fork":  # its one save answered: it exits
                    self.proc.wait()
                    self.conn.close()
            answers = self.ranks.gather(self.outcome, f"checking the background save of {self.in_flight.name}")
            failed = [a for a in answers if a is not None and a[0] != "done"]
            if failed:
                self._fail(failed, what)
            if all(a is not None for a in answers):
                self._finish(answers)
                return
            if not block:
                return

    def _fail(self, failed: list[tuple], what: str) -> None:
        """A save failed on some rank: every writer stopped (this rank's, if still at it, by a signal),
        the temporary directory reclaimed, then the one line (a writer's own failure before a peer's)."""
        if self.outcome is None:  # a peer's writer failed (or died) while this rank's still writes
            self._halt_writer(what)
        self.in_flight, self.outcome = None, None
        self._stop_writer()  # the writers' group lost a save, or a member: no more saves through it
        self.ranks.gather(None, "stopping the checkpoint writers")  # none writes in the temporary directory now
        if self.ranks.is_coordinator:
            self._reclaim()
        self.ranks.gather(None, "cleaning up after a failed background save")  # no rank ends before the clean-up
        raise SlimtuneError(next((a[1] for a in failed if a[2]), failed[0][1]))

    def _finish(self, answers: list[tuple]) -> None:
        flight, self.in_flight, self.outcome = self.in_flight, None, None
        seconds = max(a[1] for a in answers)
        nbytes, writer_peak = answers[0][2], max(a[3] for a in answers)  # the coordinator's writer lists every file
        removed = self.manager.prune() if self.ranks.is_coordinator else []
        figures = {"checkpoint_saved": flight.name, "checkpoint_save_s": seconds, "checkpoint_bytes": nbytes}
        figures.update(checkpoint_peak_rss_mb=writer_peak, checkpoint_writer_private_mb=max(a[4] for a in answers))
        self.finished.append((flight, figures))
        own = figures["checkpoint_writer_private_mb"]
        self.log(
            f"saved {flight.name} in the background ({nbytes:,} bytes, {seconds:.2f} s, writer peak RSS {writer_peak:.0f} MB, "
            f"{own:.0f} MB of it its own)" + (f"; removed {', '.join(removed)}" if removed else "")
        )

    def _answer(self, what: str, timeout: float) -> tuple | None:
        """The writer's next message if it comes (or the writer dies) within ``timeout`` seconds, else
        None; a writer that died is an ("error", one line, True) answer."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
            if not self._writer_alive():
                break
            if time.monotonic() >= deadline:
                return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return self._writer_lost(what)

    def _receive(self, what: str) -> tuple:
        """The writer's next message, however long it takes (``_answer`` without a deadline)."""
        return self._answer(what, math.inf)

    def _halt_writer(self, what: str) -> None:
        """Stop this rank's writer inside a save another rank's writer failed: it may be at its own work
        (long writes, a slow disk) or wait in a collective for the failed one. SIGTERM (it removes its
        temporary directory and answers), SIGKILL after ``_HALT_S`` without an answer (the coordinator
        reclaims what it left); its answer is dropped (the failure is the peer's)."""
        if self.thread is not None:  # one process only: no peer to fail
            self._receive(what)
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is None:
                os.kill(self.proc.pid, sig)
            deadline = time.monotonic() + _HALT_S
            while time.monotonic() < deadline:
                if self.conn.poll(0.1) or self.proc.poll() is not None:
                    return
        self.log(f"checkpoint.async: the checkpoint writer (pid {self.proc.pid}) did not end on SIGKILL within {_HALT_S:.0f} s")

    def _writer_alive(self) -> bool:
        return self.thread.is_alive() if self.thread is not None else self.proc.poll() is None

    def _writer_lost(self, what: str) -> tuple:
        if self.proc is not None:
            self.proc.wait()
            code = self.proc.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        else:
            how = "its thread ended"
        whose = f" of rank {self.ranks.rank}" if self.ranks.world_size > 1 else ""
        line = f"the checkpoint writer{whose} died ({how}) while {what}; {self.manager.out} holds the checkpoints before it"
        return ("error", line, True)

    def _reclaim(self) -> None:
        if self.manager.out.is_dir():
            self.manager.remove_leftovers()

    def _stop_writer(self) -> None:
        if self.conn is None or self.conn.closed:
            return
        try:
            self.conn.send_bytes(b"")
        except OSError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.thread is not None:
            self.thread.join()
        self.conn.close()
        self.store = None  # the writers' store (coordinator): their group is gone


def _to_host(tree: object) -> object:
    """The tensors of ``tree`` copied off a GPU into pinned host buffers (asynchronously, then one
    synchronisation); CPU tensors as they are (serialising copies them); a DTensor as its local shard
    (``_Shard``), which the writer rebuilds on its own mesh (``_rebuild``)."""
    copies = []

    def host(x: torch.Tensor) -> torch.Tensor:
        if type(x) is not torch.Tensor:
            raise SlimtuneError(f"checkpoint.async: a {type(x).__name__} in the training state (expected tensors and DTensors)")
        if not x.is_cuda:
            return x
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out.copy_(x, non_blocking=True)
        copies.append(x.device)
        return out

    def walk(x: object) -> object:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if is_dtensor(x):
                return _Shard(host(x.to_local()), tuple(x.shape), tuple(x.stride()), tuple(x.placements))
            return host(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    out = walk(tree)
    for device in set(copies):
        torch.cuda.synchronize(device)
    return out


def _rebuild(tree: object, ranks: Ranks) -> object:
    """A snapshot's ``_Shard`` entries as DTensors again, on the writers' mesh (the same shapes and
    placements: DCP writes them as the trainers' would)."""
    if isinstance(tree, _Shard):
        from torch.distributed.tensor import DTensor  # a snapshot with shards comes from a process group

        return DTensor.from_local(tree.local, device_mesh(ranks), tree.placements, run_check=False, shape=tree.shape, stride=tree.stride)
    if isinstance(tree, dict):
        return {k: _rebuild(v, ranks) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(v, ranks) for v in tree)
    return tree


def _mechanism(chosen: str, ranks: Ranks, model: nn.Module | None) -> str:
    """The writer's mechanism: ``fork`` where the trainer's model lives in host memory in one process on
    Linux (the forked writer shares it, copy-on-write); otherwise (under torchrun, a model on a GPU) the
    process that rebuilds the model from the base files. ``thread`` only when asked for (one process)."""
    if chosen not in MECHANISMS:
        raise SlimtuneError(f"{MECHANISM_ENV}={chosen!r}: expected one of {', '.join(MECHANISMS)}")
    if ranks.distributed:
        return "process"
    if chosen == "fork":
        tensors = [] if model is None else [*model.parameters(), *model.buffers()]
        on_host = bool(tensors) and all(t.device.type == "cpu" for t in tensors)
        return "fork" if on_host and hasattr(os, "fork") and sys.platform == "linux" else "process"
    return chosen


class _ForkedWriter:
    """A forked writer, as much of a ``subprocess.Popen`` as the saver uses: ``poll``, ``wait``,
    ``returncode`` (negative: the signal that killed it)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:  # timeout as Popen's: waited for once it answered or died
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _fork_writer(model: nn.Module, manager: CheckpointManager, request: dict, nice: int) -> tuple[_ForkedWriter, Connection]:
    """Fork the writer of one save, at ``nice``: its memory is the trainer's at this instant (the model,
    the training state's tensors: copy-on-write, nothing copied now); it writes the checkpoint and exits."""
    ours, theirs = socket.socketpair()
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered before the fork is written twice
        stream.flush()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _forked_main(Connection(theirs.detach()), model, manager, request, parent, nice)
    theirs.close()
    return _ForkedWriter(pid), Connection(ours.detach())


def _forked_main(conn: Connection, model: nn.Module, manager: CheckpointManager, request: dict, parent: int, nice: int) -> None:
    """The forked writer: never returns into the trainer's code (``os._exit``)."""
    code = 1
    try:
        gc.disable()  # the trainer's objects are the snapshot: no finalizer of theirs runs here
        if _become_writer(parent, threads=1):  # GNU OpenMP's pool does not survive a fork: more threads hang
            os.nice(nice)
            conn.send(_write(model, manager, request, SINGLE))
            code = 0
    except BaseException:  # noqa: BLE001 - a lost writer is the trainer's one line (_writer_lost)
        pass
    finally:
        os._exit(code)


def _become_writer(parent: int, threads: int) -> bool:
    """Set up a writer process: it dies with its parent (SIGTERM, which removes its temporary directory),
    is named ``slimtune-ckpt`` and computes on ``threads`` threads. False if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(WRITER_NAME), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a dead trainer's writer ends at its next read of the closed connection
    if os.getppid() != parent:
        return False  # the trainer died before the prctl above
    raise_on_sigterm("the checkpoint writer was stopped by SIGTERM (its trainer ended)")
    torch.set_num_threads(threads)
    return True


def _writer_group(ranks: Ranks) -> tuple[object, WriterGroup | None]:
    """Under a process group: a store on the coordinator (a free port) for the writers to meet at, its
    port sent to every rank. Returns (the store, held by the coordinator; this rank's ``WriterGroup``)."""
    if not ranks.distributed:
        return None, None
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = None
    if ranks.is_coordinator:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_GROUP_TIMEOUT)
    port = ranks.broadcast(store.port if store is not None else None, "starting the checkpoint writers")
    return store, WriterGroup(host, port, ranks.rank, ranks.world_size)


def _join_writers(group: WriterGroup | None) -> Ranks:
    """The writer's place among the writers: their own gloo group (alone: ``SINGLE``). Joining fails
    after ``_JOIN_TIMEOUT`` (a writer that never came); the group's collectives then wait ``_GROUP_TIMEOUT``."""
    if group is None:
        return SINGLE
    try:  # every writer checks in at the store first: that wait is bounded, the group's own (init's) is not
        store = dist.TCPStore(group.host, group.port, is_master=False, timeout=_JOIN_TIMEOUT)
        store.set(f"slimtune-writer-{group.rank}", "here")
        store.wait([f"slimtune-writer-{r}" for r in range(group.world_size)], _JOIN_TIMEOUT)
    except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        within = f"{_JOIN_TIMEOUT.total_seconds():.0f} s"
        raise SlimtuneError(f"the checkpoint writers did not all join their group within {within} ({first})") from None
    store.set_timeout(_GROUP_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=group.rank, world_size=group.world_size, timeout=_GROUP_TIMEOUT)
    return current_ranks()


def _start_process(end: socket.socket) -> subprocess.Popen:
    """The writer: ``python -c`` running ``writer_main`` on its end of the socket pair."""
    fd = end.detach()
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # the writer is no rank of a job
    code = (  # logging off before the imports: the trainer has said everything importing and loading say (torchao's notes)
        "import logging, sys; logging.disable(logging.WARNING); "
        "from slimtune.checkpoint.background import writer_main; writer_main(int(sys.argv[1]), int(sys.argv[2]))"
    )
    try:
        return subprocess.Popen([sys.executable, "-c", code, str(fd), str(os.getpid())], pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)
    finally:
        os.close(fd)


def writer_main(fd: int, parent: int) -> None:
    """The writer process: dies with its parent (SIGTERM, which removes its temporary directory),
    then serves save requests until the trainer closes the connection."""
    if not _become_writer(parent, threads=max(1, usable_cores() // 2)):
        return
    logging.disable(logging.WARNING)  # the trainer has said everything loading says (also set by _start_process's code)
    try:
        _serve(Connection(fd), speak=True)
    except (SlimtuneError, KeyboardInterrupt):
        pass


def _serve(conn: Connection, speak: bool = False) -> None:
    """Join the writers' group (under a process group), load the model as the trainer did, say ready,
    then write each request's checkpoint."""
    spec = None
    try:
        spec, out = conn.recv()
        try:
            ranks = _join_writers(spec.group)
            model = _load(spec, ranks)
        except Exception as e:  # noqa: BLE001 - the trainers save synchronously instead
            conn.send(("failed", str(e)))
            return
        conn.send(("ready",))
        params = dict(model.named_parameters())
        manager = CheckpointManager(out)
        if speak:
            _speak_after_loading()
        while data := conn.recv_bytes():
            conn.send(_write(model, manager, torch.load(io.BytesIO(data), map_location="cpu", weights_only=False), ranks, params))
    except EOFError:
        return
    finally:
        conn.close()
        if spec is not None and spec.group is not None:
            shutdown()


def _speak_after_loading() -> None:
    """A writer process is silent while it loads (the trainer has said all that); once it serves, slimtune's
    own lines (a damaged step-N the save moves aside) print as the trainer's do, the libraries' stay quiet."""
    logging.disable(logging.NOTSET)
    logging.getLogger().setLevel(logging.ERROR)
    configure_logging()


def _load(spec: WriterSpec, ranks: Ranks) -> nn.Module:
    """The trainer's model, frozen weights and all (this rank's shards of them under a process group);
    any writer's failure fails every writer (one line)."""
    before = base_fingerprint(spec.model_dir)
    model, error = None, None
    try:
        model = load_qlora_model(spec.model_dir, spec.lora, seed=spec.seed, progress=False, ranks=ranks, dtype=spec.dtype)
        if base_fingerprint(spec.model_dir) != before:
            error = SlimtuneError(f"the base files in {spec.model_dir} changed while the checkpoint writer loaded them")
    except Exception as e:  # noqa: BLE001 - one line for the trainer
        error = SlimtuneError(f"the checkpoint writer cannot load {spec.model_dir} ({type(e).__name__}: {e})")
    ranks.agree(error, "loading the checkpoint writers' model")
    return model


def _write(
    model: nn.Module, manager: CheckpointManager, request: dict, ranks: Ranks, params: dict | None = None, own_process: bool = True
) -> tuple:
    """One checkpoint from one snapshot, by the one save path (every writer its part under a process
    group); ``params``: the writer's own model's parameters, into which the snapshot's adapters go
    first (a forked writer's model is the trainer's). ("done", seconds, bytes, peak RSS MB, private MB)
    or ("error", one line, whether the cause is this writer's own rather than a peer's). Not
    ``own_process`` (in the trainer's): its peak RSS is not reset, and no memory is the writer's own."""
    started = time.perf_counter()
    if own_process:
        reset_peak_rss()
    try:
        with torch.no_grad():
            for name, value in request["train_state"]["adapter"].items() if params is not None else ():
                target = params[name].to_local() if is_dtensor(params[name]) else params[name]
                target.copy_(value.local if isinstance(value, _Shard) else value)
        train_state = _rebuild(request["train_state"], ranks)
        with tempfile.TemporaryDirectory(prefix="slimtune-async-") as tmp:
            extra = {}
            for i, (name, data) in enumerate(request["extra"].items()):
                extra[name] = Path(tmp) / f"{i}-{Path(name).name}"
                extra[name].write_bytes(data)
            options = dataclasses.replace(request["options"], extra_files=extra)
            result = manager.save(model, request["step"], request["state"], options, train_state, ranks)
    except SlimtuneError as e:
        return ("error", str(e), not isinstance(e, PeerFailure))
    except Exception as e:  # noqa: BLE001 - one line for the trainer
        return ("error", f"the checkpoint writer failed writing step-{request['step']:06d}: {type(e).__name__}: {e}", True)
    return ("done", time.perf_counter() - started, result.total_bytes, peak_rss_mb(), private_mb() if own_process else 0.0)
