"""The trainer's side of the background save: ``BackgroundSaver`` keeps the policy, a ``Writer``
(``protocol.py``) does the writing.

The policy: at most one save in flight (a save point reached while the previous save runs waits for
it, and the wait is stall; a writer that yields the CPU then runs the next saves less nice, 19 -> 10 ->
0); the run's last save point waits for the save in flight, then the trainer writes that last save
itself, synchronously (no training is left to overlap: all its threads are the save's, where a
forked writer runs one); ``keep_last_n`` prunes after a save is complete; and under a
process group the ranks agree: whether the writers can take saves at all, and when a save is over or
failed. While one is in flight each step exchanges every rank's writer's answer (one small gather), so
every rank finishes it, or raises the same line, at the same step; a trainer waiting for its writer
exchanges every ``_WAIT_POLL_S`` meanwhile. Where one writer failed or died, a writer still at work is
halted by its trainer before the coordinator reclaims the temporary directory.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from slimtune.checkpoint.background.forked import ForkedWriter
from slimtune.checkpoint.background.process import ProcessWriter
from slimtune.checkpoint.background.protocol import Answer, Done, Failed, Request, Writer, WriterKind, WriterSetup, WriterSpec
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import SaveOptions
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError

log = logging.getLogger(__name__)

MECHANISM_ENV = "SLIMTUNE_ASYNC_WRITER"  # "fork" or "process": which writer a run asks for (fork where it can)
WRITERS: dict[WriterKind, Callable[[WriterSetup], Writer]] = {WriterKind.FORK: ForkedWriter, WriterKind.PROCESS: ProcessWriter}
# The forked writer's nice values: it starts at 19 (it takes the CPU training leaves, and all of it while
# training waits for it); each save point that finds the previous save still running moves it one down.
FORKED_WRITER_NICE = (19, 10, 0)
# A trainer waiting for its writer's answer exchanges answers with the other ranks this often meanwhile.
_WAIT_POLL_S = 1.0
_CUSTOM: contextvars.ContextVar[Callable[[WriterSetup], Writer] | None] = contextvars.ContextVar("slimtune_writer", default=None)


@contextmanager
def custom_writer(make: Callable[[WriterSetup], Writer]) -> Iterator[None]:
    """Every ``BackgroundSaver`` made inside the block writes through ``make(setup)`` instead of the
    writer its kind names (a benchmark's writer, a test's).

    Example: ``with custom_writer(ThreadWriter): run_finetune(cfg)``"""
    token = _CUSTOM.set(make)
    try:
        yield
    finally:
        _CUSTOM.reset(token)


def choose_kind(asked: WriterKind | str, ranks: Ranks, model: nn.Module | None) -> WriterKind:
    """The run's writer: ``FORK`` where the trainer's model lives in host memory in one process on Linux
    (the forked writer shares it, copy-on-write); otherwise (under torchrun, a model on a GPU, or asked
    for) the process that rebuilds the model from the base files."""
    try:
        kind = WriterKind(asked)
    except ValueError:
        raise SlimtuneError(f"{MECHANISM_ENV}={asked!r}: expected one of {', '.join(k.value for k in WriterKind)}") from None
    tensors = [] if model is None else [*model.parameters(), *model.buffers()]
    on_host = bool(tensors) and all(t.device.type == "cpu" for t in tensors)
    can_fork = on_host and not ranks.distributed and hasattr(os, "fork") and sys.platform == "linux"
    return kind if can_fork else WriterKind.PROCESS


@dataclasses.dataclass
class _Flight:
    """The save in flight: its step, its name, when it was handed over, the throughput of the steps during it."""

    step: int
    name: str
    started: float
    step_rates: list[float] = dataclasses.field(default_factory=list)


class BackgroundSaver:
    """The trainer's side of the writer (module docstring). One per run on each rank; under a process
    group (``ranks``) every rank calls each method at the same steps, and the ranks decide together
    when a save is over (or failed).

    Example::

        saver = BackgroundSaver(WriterSpec(model_dir, lora, seed=0, dtype=torch.bfloat16), manager, model=model)
        if saver.available(step):
            stall_s = saver.submit(step, state, options, train_state)   # returns once the snapshot is sent
        saver.annotate(record)        # every step: in-flight flag, a finished save's figures; raises a failure
        saver.close()                 # waits for the last save
    """

    def __init__(
        self,
        spec: WriterSpec,
        manager: CheckpointManager,
        kind: WriterKind | str | None = None,
        ranks: Ranks = SINGLE,
        model: nn.Module | None = None,
    ):
        self.manager, self.ranks = manager, ranks
        self.kind = choose_kind(kind or os.environ.get(MECHANISM_ENV) or WriterKind.FORK, ranks, model)
        self.writer: Writer = (_CUSTOM.get() or WRITERS[self.kind])(WriterSetup(spec, manager, ranks, model))
        self.in_flight: _Flight | None = None
        self.answer: Answer | None = None  # this rank's writer's answer for the save in flight
        self.unusable: str | None = None  # why saves are synchronous from now on
        self.busy: _Flight | None = None  # the save in flight when the current step began
        self.finished: list[tuple[_Flight, dict]] = []  # saves finished since the last annotate
        self.outside_rates: list[float] = []  # tokens/s of the steps that ran during no save
        self.snapshot_bytes: int | None = None  # the size of this step's snapshot, for its record
        self.ready_wait_s = 0.0  # the wait for the writer in ``available``: stall too
        self.nice = FORKED_WRITER_NICE[0]  # the next forked writer's

    # --- the save point ---------------------------------------------------------------------------

    def available(self, step: int) -> bool:
        """Whether the save at ``step`` can go to the writer (``Writer.unusable``: the process writer
        waits to be ready, and its base files must be unchanged since the run started); under a process
        group, on every rank. The first time not, one log line; from then on every save is synchronous."""
        if self.unusable is not None:
            return False
        started = time.perf_counter()
        why = self.writer.unusable(step)
        self.ready_wait_s = time.perf_counter() - started  # stall too: submit adds it
        if self.ranks.world_size > 1:  # every rank saves the same way
            reasons = self.ranks.gather(why, f"starting the background save of step-{step:06d}")
            why = next((f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason is not None), None)
        if why is not None:
            self.unusable = why
            log.info(f"checkpoint.async: {why}; saving synchronously from step {step} on")
            self.writer.stop()
        return why is None

    def submit(self, step: int, state: dict, options: SaveOptions, train_state: dict) -> float:
        """Wait for the save in flight (if any), then hand the writer the snapshot: ``train_state``, the
        recipe state and the small files of ``options`` (their bytes now). Returns the seconds the
        caller was blocked (with any wait for the writer to be ready in ``available``)."""
        started = time.perf_counter() - self.ready_wait_s
        self.ready_wait_s = 0.0
        if self.in_flight is not None:
            if self.writer.yields_cpu and self.answer is None:
                self.answer = self.writer.poll(0.0)
                if self.answer is None:
                    self._less_nice(step)  # the previous writer is late: the next one yields less to training
            self._settle(block=True)
        extra = {name: Path(path).read_bytes() for name, path in (options.extra_files or {}).items()}
        request = Request(step, state, dataclasses.replace(options, extra_files=None), extra, train_state, self.nice)
        self.in_flight = _Flight(step, request.name, time.perf_counter())
        self.snapshot_bytes = self.writer.submit(request)
        return time.perf_counter() - started

    # --- every step ---------------------------------------------------------------------------------

    def annotate(self, record: dict, last: bool = False) -> None:
        """Fill a step's metrics record: ``checkpoint_in_flight`` (a save ran during the step), and for a
        save that finished, ``checkpoint_saved``, ``checkpoint_save_s`` (its background duration),
        ``checkpoint_bytes``, ``checkpoint_peak_rss_mb`` (the writer's; under a process group the largest
        writer's), ``checkpoint_snapshot_bytes`` (on the save point's step), ``tokens_per_s_during_save`` and
        ``tokens_per_s_outside_save`` (mean throughput of the steps that ran during it, and of the steps
        so far that ran during no save). ``last``: the run ends here; wait for the save in flight
        (``checkpoint_final_wait_s``); where two saves finish in one step (or a background save finishes
        on a step that wrote its own save synchronously), the earlier one's figures go to
        ``checkpoint_also_saved``. Raises the writer's failure as one line (any rank's writer's, on
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
        if self.snapshot_bytes is not None:  # this step's save point: the snapshot's size
            record["checkpoint_snapshot_bytes"], self.snapshot_bytes = self.snapshot_bytes, None
        for flight, figures in self.finished:
            if flight.step_rates:
                figures["tokens_per_s_during_save"] = sum(flight.step_rates) / len(flight.step_rates)
            if self.outside_rates:
                figures["tokens_per_s_outside_save"] = sum(self.outside_rates) / len(self.outside_rates)
            if "checkpoint_save_s" in record and "checkpoint_saved" not in record:  # the step's own save, written after it
                record.setdefault("checkpoint_also_saved", []).append(figures)
                continue
            if "checkpoint_saved" in record:  # two finished in one step (the last one waited for the one before)
                record.setdefault("checkpoint_also_saved", []).append({k: record[k] for k in figures if k in record})
            record.update(figures)
        self.finished = []
        self.busy = self.in_flight

    def wait(self) -> float:
        """Wait for the save in flight (if any; its figures go to the next ``annotate``); the seconds waited.
        The run's last save point calls it before writing that save itself (``save_step``)."""
        started = time.perf_counter()
        if self.in_flight is not None:
            self._settle(block=True)
        return time.perf_counter() - started

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer."""
        if self.in_flight is not None:
            self._settle(block=True)
        self.writer.stop()

    # --- internals ----------------------------------------------------------------------------------

    def _less_nice(self, step: int) -> None:
        lower = [n for n in FORKED_WRITER_NICE if n < self.nice]
        if lower:
            self.nice = lower[0]
            log.info(f"checkpoint.async: the save before step {step}'s was still running; the next writers run at nice {self.nice}")

    def _settle(self, block: bool) -> None:
        """This rank's writer's answer for the save in flight (with ``block`` waited for, else taken if
        there), exchanged between the ranks: the save is over when every writer answered, and failed
        when any writer did; every rank takes the same decision at the same step. A blocking wait
        exchanges every ``_WAIT_POLL_S`` too, so a rank learns of a peer's failure while its own writer
        still works (and halts it)."""
        while True:
            if self.answer is None:
                self.answer = self.writer.poll(_WAIT_POLL_S if block else 0.0)
            answers = self.ranks.gather(self.answer, f"checking the background save of {self.in_flight.name}")
            failed = [a for a in answers if isinstance(a, Failed)]
            if failed:
                self._fail(failed)
            if all(a is not None for a in answers):
                self._finish(answers)
                return
            if not block:
                return

    def _fail(self, failed: list[Failed]) -> None:
        """A save failed on some rank: every writer stopped (this rank's, if still at it, halted), the
        temporary directory reclaimed, then the one line (a writer's own failure before a peer's)."""
        if self.answer is None:  # a peer's writer failed (or died) while this rank's still writes
            self.writer.halt()
        self.in_flight, self.answer = None, None
        self.writer.stop()  # the writers' group lost a save, or a member: no more saves through it
        self.ranks.gather(None, "stopping the checkpoint writers")  # none writes in the temporary directory now
        if self.ranks.is_coordinator and self.manager.out.is_dir():
            self.manager.remove_leftovers()
        self.ranks.gather(None, "cleaning up after a failed background save")  # no rank ends before the clean-up
        raise SlimtuneError(next((a.line for a in failed if a.own), failed[0].line))

    def _finish(self, answers: list[Done]) -> None:
        flight, self.in_flight, self.answer = self.in_flight, None, None
        seconds, writer_peak = max(a.seconds for a in answers), max(a.peak_rss_mb for a in answers)
        nbytes, own = answers[0].nbytes, max(a.private_mb for a in answers)  # the coordinator's writer lists every file
        removed = self.manager.prune() if self.ranks.is_coordinator else []
        figures = {"checkpoint_saved": flight.name, "checkpoint_save_s": seconds, "checkpoint_bytes": nbytes}
        figures.update(checkpoint_peak_rss_mb=writer_peak, checkpoint_writer_private_mb=own)
        self.finished.append((flight, figures))
        log.info(
            f"saved {flight.name} in the background ({nbytes:,} bytes, {seconds:.2f} s, writer peak RSS {writer_peak:.0f} MB, "
            f"{own:.0f} MB of it its own)" + (f"; removed {', '.join(removed)}" if removed else "")
        )
