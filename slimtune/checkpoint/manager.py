"""The run directory of a fine-tuning run, as torchtitan's CheckpointManager owns it: ``step-NNNNNN``
checkpoints (each written atomically by ``save_checkpoint``, with the recipe state inside), the resume
point, pruning (``keep_last_n``), leftovers of killed processes, damaged
checkpoints, and where ``metrics.jsonl`` and ``loss.png`` live (``tracking.MetricsLog`` writes the former).

Faults: every failed write is one ``SlimtuneError`` line (exit status 2) and never costs an earlier
checkpoint. A damaged or incomplete ``step-N`` that the run must write again is moved aside to
``step-N.damaged-<time>`` (never deleted). The recipe state carries the checkpoint step's metrics line,
so a kill between a checkpoint's rename and that line loses nothing: resume writes it back. Paths under
output_dir are compared relative to it, so a moved run directory resumes.

Inside a checkpoint the state is in two parts: ``recipe_state.pt`` holds the run's facts that resume
checks before anything is loaded (format, step, config, data hash), written by the coordinator; the
training state (adapters, optimizer, scheduler, loss scaler, data position, each rank's RNG) is
written by every rank together into ``train_state/`` (``checkpoint/train_state.py``, through
``torch.distributed.checkpoint``). What the state holds and what may change on resume: ``run_state.py``.
Messages go to the ``slimtune.checkpoint.manager`` logger (``cli.configure_logging`` prints them).

Example::

    manager = CheckpointManager(out, keep_last_n=2)
    resume = manager.find_resume_point(resume=True, overwrite=False)   # None: start at step 0
    manager.prepare(fresh_start=resume is None, overwrite=False)        # mkdir, leftovers, overwrite
    result = manager.save(model, step, state, SaveOptions(WriteOptions(adapter_only=True)), train_state)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from slimtune.checkpoint.atomic import MANIFEST_NAME, is_complete_checkpoint, live_temporaries, reclaim_leftovers
from slimtune.checkpoint.run_state import ResumePoint, portable_config, state_problem
from slimtune.checkpoint.save import ExtraFile, SaveOptions, SaveResult, save_checkpoint
from slimtune.checkpoint.train_state import TRAIN_STATE_DIR, save_train_state
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.fileio import os_errors
from slimtune.formats.layout import ADAPTER_WEIGHTS_PATH, STATE_NAME
from slimtune.formats.manifest import manifest_problems

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"
STEP_DIR = re.compile(r"^step-(\d+)$")
log = logging.getLogger(__name__)
# How long a run waits for a live process's temporary directory in its output_dir to go: a background
# writer outlives its killed trainer by seconds (checkpoint/background/reaper.py); longer, another run writes there.
WRITER_WAIT_S = 60.0
_LEFTOVER = re.compile(r"^\.step-\d+\.deleting-[0-9a-f]{8}$|^\.recipe_state-")  # temporaries: atomic.reclaim_leftovers


class CheckpointManager:
    """Owns ``out``: which step directories exist, which one a run resumes from, writing and pruning them."""

    def __init__(self, out: str | Path, keep_last_n: int | None = None):
        self.out = Path(out)
        self.keep_last_n = keep_last_n

    @property
    def metrics_path(self) -> Path:
        return self.out / METRICS_NAME

    @property
    def plot_path(self) -> Path:
        return self.out / PLOT_NAME

    def step_path(self, step: int) -> Path:
        return self.out / f"step-{step:06d}"

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Checkpoint directories step-N under out, newest first (complete or not)."""
        if not self.out.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.out.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    def find_resume_point(self, resume: bool, overwrite: bool) -> ResumePoint | None:
        """The newest complete checkpoint with recipe state, skipping incomplete or damaged ones; None
        for a fresh start. Without resume, existing checkpoints are an error unless ``overwrite``. First
        waits for the writers still at work in ``out`` (``wait_for_writers``)."""
        self.wait_for_writers()
        existing = self.step_dirs()
        if not resume:
            if existing and not overwrite:
                names = ", ".join(p.name for _, p in existing[:3]) + (" ..." if len(existing) > 3 else "")
                raise SlimtuneError(
                    f"{self.out} already holds checkpoints ({names}); pass resume=true to continue that run or overwrite=true to start over"
                )
            return None
        for _, path in existing:
            problem = checkpoint_problem(path)
            if problem:
                log.info(f"resume: skipping {path.name}: {problem}")
                continue
            try:
                state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
            except Exception as e:  # a damaged file is skipped like an incomplete checkpoint
                log.info(f"resume: skipping {path.name}: cannot read {STATE_NAME} ({e})")
                continue
            problem = state_problem(state)
            if problem:
                log.info(f"resume: skipping {path.name}: {STATE_NAME} {problem}")
                continue
            return ResumePoint(path, state)
        log.info(f"resume: no complete checkpoint under {self.out}; starting from step 0")
        return None

    def wait_for_writers(self, timeout: float | None = None) -> None:
        """Wait until no live process writes a temporary directory in ``out`` (at most ``timeout`` s,
        default ``WRITER_WAIT_S``): a background writer of a run killed a moment ago may still be finishing,
        and a run must neither resume beside it nor clear or reclaim what it writes. After the wait its
        temporary directory is reclaimed by its lock (``prepare``)."""
        timeout = WRITER_WAIT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        live = live_temporaries(self.out)
        if live:
            log.info(f"waiting for {', '.join(live)} in {self.out}: a process still writes it (the writer of a run that ended?)")
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = live_temporaries(self.out)
        if live:
            raise SlimtuneError(
                f"{self.out}: a live process still writes {live[0]} after {timeout:.0f} s; is another run writing to this output_dir?"
            )

    def prepare(self, fresh_start: bool, overwrite: bool) -> None:
        """Create out, remove leftovers of interrupted saves and, for a fresh start with ``overwrite``,
        the previous run's checkpoints, metrics and plot. Nothing is written before this."""
        with os_errors("write to output_dir", self.out):
            self.out.mkdir(parents=True, exist_ok=True)
            self.remove_leftovers()
            if fresh_start and overwrite:
                self.clear_previous_run()

    def remove_leftovers(self) -> None:
        """Temporary directories of saves or deletions killed processes left behind (never checkpoints,
        never the temporaries of a live writer)."""
        for name in reclaim_leftovers(self.out, lockless=True):
            log.info(f"removing {name}, left by an interrupted save")
        for path in self.out.iterdir():
            if _LEFTOVER.match(path.name):
                log.info(f"removing {path.name}, left by an interrupted save")
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def clear_previous_run(self) -> None:
        """overwrite=true: the previous run's checkpoints, metrics and plot go (nothing else in out)."""
        doomed = [path for _, path in self.step_dirs()]
        for path in doomed:
            delete_checkpoint(path)
        for path in (self.metrics_path, self.plot_path):
            path.unlink(missing_ok=True)
        if doomed:
            log.info(f"overwrite: {len(doomed)} checkpoint(s) of the previous run in {self.out} removed")

    def save(
        self, model: nn.Module, step: int, state: dict, options: SaveOptions, train_state: dict | None = None, ranks: Ranks = SINGLE
    ) -> SaveResult:
        """Write ``step-N`` with the recipe state inside (written before the manifest, so a checkpoint
        that has a manifest has its state); every rank calls this. ``train_state`` (nested dicts of
        tensors, DTensors and plain values) goes through DCP into ``train_state/``, every rank writing
        its shards. A ``step-N`` already there is one the resume point passed over (incomplete or
        damaged): the coordinator moves it aside, never deletes it."""
        ckpt = self.step_path(step)
        if ranks.is_coordinator and ckpt.exists():
            self.set_aside(ckpt)
        state = {**state, "config": portable_config(state["config"])} if "config" in state else state
        options = replace(
            options,
            write=replace(options.write, progress=False),
            extra_files={STATE_NAME: ExtraFile(_state_size(state), partial(_write_state, state)), **(options.extra_files or {})},
        )
        return save_checkpoint(model, ckpt, options, ranks, None if train_state is None else partial(save_train_state, train_state))

    def set_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint to ``NAME.damaged-<UTC time>``, where the user will see it."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = path.with_name(f"{path.name}.damaged-{stamp}")
        while aside.exists():
            aside = path.with_name(f"{path.name}.damaged-{stamp}-{uuid.uuid4().hex[:4]}")
        with os_errors("move aside the damaged checkpoint", path):
            os.rename(path, aside)
        problem = checkpoint_problem(aside) or "not the run's checkpoint"
        log.info(f"{path.name} was damaged ({problem}); moved aside to {aside.name} (kept: delete it yourself once unneeded)")
        return aside

    def prune(self) -> list[str]:
        """Delete complete checkpoints beyond the newest ``keep_last_n``; the newest complete one always stays."""
        if self.keep_last_n is None:
            return []
        complete = [p for _, p in self.step_dirs() if is_complete_checkpoint(p)]
        removed = []
        with os_errors("delete an old checkpoint in", self.out):
            for path in complete[max(1, self.keep_last_n) :]:
                delete_checkpoint(path)
                removed.append(path.name)
        return removed


class CreatedByRun:
    """What a fresh run adds: ``out`` itself or its new entries, and the embedded base or built-in data
    where they lie outside it. ``undo()`` removes them when the run fails before its first complete
    checkpoint, so a failed command leaves nothing behind; once a checkpoint exists the run directory is
    resumable state and stays as it is. A directory that held a complete checkpoint before is never touched,
    nor is a checkpoint set aside as damaged.

    Example::

        created = CreatedByRun(out, [model_dir, dataset_path])
        try:
            train()
        except BaseException:
            created.undo()
            raise
    """

    def __init__(self, out: Path, others: list[Path]):
        self.out = Path(out)
        self.existed = self.out.exists()
        self.entries = set(os.listdir(self.out)) if self.out.is_dir() else set()
        self.had_checkpoint = any(is_complete_checkpoint(p) for _, p in CheckpointManager(self.out).step_dirs())
        self.others = [Path(p) for p in others if not Path(p).exists() and not Path(p).is_relative_to(self.out)]

    def undo(self) -> None:
        if self.had_checkpoint or any(is_complete_checkpoint(p) for _, p in CheckpointManager(self.out).step_dirs()):
            return
        if not self.existed:
            doomed = [self.out]
        elif self.out.is_dir():
            doomed = [self.out / n for n in os.listdir(self.out) if n not in self.entries and ".damaged-" not in n]
        else:
            doomed = []
        doomed += self.others
        removed = []
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
            if not path.exists():
                removed.append(path.name)
        if removed:
            log.info(f"the run failed before its first checkpoint: removed what it created ({', '.join(sorted(removed))})")


def _state_size(state: object) -> int:
    """An upper estimate of ``torch.save(state)``'s size: tensor bytes, an allowance per object and 1 MiB."""
    total, keys = 1024 * 1024, set()
    for path, x in pytree.tree_leaves_with_path(state):
        keys.update(path[: i + 1] for i, k in enumerate(path) if isinstance(k, pytree.MappingKey))  # each dict key once
        total += x.untyped_storage().nbytes() + 4096 if isinstance(x, torch.Tensor) else _object_size(x)
    return total + sum(_object_size(p[-1].key) for p in keys)


def _object_size(x: object) -> int:
    return 256 + (len(x) if isinstance(x, (str, bytes)) else 0)


def _write_state(state: dict, path: Path) -> None:
    with open(path, "wb") as f:  # a file object: torch's writer calls f.write, so a failed write is an OSError
        try:
            torch.save(state, f)
        except RuntimeError as e:  # ... that torch's zip writer may replace with its own error on the way out
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None if it can): it needs its manifest, and the recipe
    state, training state metadata and adapter must match the sizes and hashes the manifest recorded."""
    if not is_complete_checkpoint(path):
        return f"incomplete (no {MANIFEST_NAME})"
    for name in (STATE_NAME, f"{TRAIN_STATE_DIR}/.metadata", ADAPTER_WEIGHTS_PATH):
        problems = manifest_problems(path, only=[name], extra=False)
        if problems:
            return (
                f"no {name}"
                if problems[0].endswith(("missing", "not listed in the manifest"))
                else f"{name} does not match its manifest entry"
            )
    return None


def delete_checkpoint(path: Path) -> None:
    """Rename to a hidden name first: a kill during the deletion leaves no half-deleted step-N."""
    doomed = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)
