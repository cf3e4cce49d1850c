"""What a run holds between its steps: ``Run``, made by ``run_steps.prepare`` by keyword, advanced by the
steps (``recipes/run_steps.py``, ``recipes/finetune.py``). The parts that travel together are small objects
of their own: ``DevicePlacement`` (ranks, device, dtype, threads), ``StepParts`` (what an optimizer step
works on, made once per run), ``Inputs`` (tokenizer, data), ``Span`` (how many steps),
``Progress`` (where the run is), ``Optimization`` (``checkpoint/run_state.py``: optimizer, schedule, loss
scaler) and ``Sinks`` (metrics.jsonl, trackers, memory figures, progress bar). ``FinetuneResult`` is
what a run leaves behind.

Example: ``run = Run(cfg=cfg, where=where, manager=manager, resume=None, inputs=inputs, model=model, optim=optim, span=span)``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from slimtune.checkpoint.background import BackgroundSaver
from slimtune.checkpoint.extras import CheckpointDocs
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.run_state import Optimization, ResumePoint
from slimtune.checkpoint.save import SaveResult
from slimtune.config import Config
from slimtune.data import Data
from slimtune.distributed import Ranks
from slimtune.formats.hub import ModelSource
from slimtune.memory import HeapTrim, PeakMemory
from slimtune.model import config_dtype
from slimtune.tracking import MetricsLog, Trackers


@dataclass
class FinetuneResult:
    """What a run leaves behind, for the CLI summary and the demo's checks."""

    model: nn.Module
    tokenizer: object
    output_dir: Path
    global_step: int
    losses: list[float] = field(default_factory=list)  # this invocation's steps
    checkpoint: Path | None = None  # the newest checkpoint written by this invocation
    last_save: SaveResult | None = None
    rss_before_last_save_mb: float = 0.0
    peak_rss_last_save_mb: float = 0.0
    peak_rss_mb: float = 0.0  # the whole process, loading included
    peak_gpu_mb: float | None = None
    metrics_path: Path | None = None
    plot_path: Path | None = None


TRIM_COST_SHARE = 0.02  # the step's heap trims may cost ~2% of the training time (memory.HeapTrim)


def step_heap_trim() -> HeapTrim:
    """The heap trim a run keeps across its steps (``StepParts.trim``): after each micro-batch's backward,
    what the step freed goes back to the system once the process grew 64 MB, at most as often as keeps
    the re-faulting under ``TRIM_COST_SHARE`` of the time.

    Example: ``parts = StepParts(..., trim=step_heap_trim())``"""
    return HeapTrim(cost_share=TRIM_COST_SHARE)


@dataclass
class StepParts:
    """What an optimizer step works on (``train_loop.optimizer_step``), made once per run (``Run.parts``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    params: list[nn.Parameter]
    max_grad_norm: float | None
    device: torch.device
    trim: HeapTrim = field(default_factory=step_heap_trim)  # the run's, kept across its steps


@dataclass(frozen=True)
class DevicePlacement:
    """Where the run computes: this process's ranks, the device, the compute dtype, the CPU threads."""

    ranks: Ranks
    device: torch.device
    dtype: torch.dtype
    threads: int


@dataclass
class Inputs:
    """What the run reads before its model: the tokenizer, the base's HF config, the tokenized data and
    the built-in rows ``restore`` writes (None when the data file exists)."""

    tokenizer: object
    hf_config: object
    data: Data
    base: ModelSource  # model.path resolved: its directory, and the hub id and commit it came from
    builtin_rows: list[dict] | None = None

    @property
    def pad_id(self) -> int:
        """What batches are padded with: the tokenizer's pad token, else its eos, else 0."""
        return next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)


@dataclass(frozen=True)
class Span:
    """The run's step arithmetic: optimizer steps per epoch, in all, and where this invocation stops."""

    steps_per_epoch: int
    total_steps: int
    stop_at: int  # training.stop_after_steps, or total_steps


@dataclass
class Progress:
    """Where the run is: the last optimizer step taken and the data position of the next one."""

    global_step: int = 0
    epoch: int = 0  # 0-based
    step_in_epoch: int = 0  # the next step of the epoch, 0-based
    position: tuple[int, int] = (0, 0)  # (epoch, step_in_epoch) after the step being taken
    first_step: int = 1  # this invocation's first step


@dataclass
class Sinks:
    """Where each step's record goes (the coordinator's metrics.jsonl, the trackers, the progress bar)
    and the run's memory figures. Opened by ``restore``."""

    metrics: MetricsLog | None = None
    trackers: Trackers = field(default_factory=Trackers)
    memory: PeakMemory | None = None
    bar: tqdm | None = None


@dataclass(kw_only=True)
class Run:
    """Everything a run holds between its steps: made by ``run_steps.prepare`` (keyword arguments only),
    advanced by the other steps. Its ``parts`` (what the optimizer step works on) are made here, once."""

    cfg: Config
    where: DevicePlacement
    manager: CheckpointManager
    resume: ResumePoint | None  # None: a fresh start
    inputs: Inputs
    model: nn.Module
    optim: Optimization
    span: Span
    at: Progress = field(default_factory=Progress)  # where the run is: run.at.global_step
    record: dict = field(default_factory=dict)  # the metrics record of the step being taken
    last_eval: dict | None = None
    docs: CheckpointDocs | None = None
    sinks: Sinks = field(default_factory=Sinks)
    result: FinetuneResult | None = None
    saver: BackgroundSaver | None = None  # checkpoint.async: the background writer
    extra_state: dict = field(default_factory=dict)  # the objective's own facts in every checkpoint's recipe state (containers, tensors)
    objective: Any = None  # the run's Objective (recipes/objective.py), set by finetune.setup
    parts: StepParts = field(init=False)  # the optimizer step's, with the heap trim kept across the steps

    def __post_init__(self):
        params = [p for g in self.optim.optimizer.param_groups for p in g["params"]]
        optim, max_norm = self.optim, self.cfg.training.max_grad_norm
        self.parts = StepParts(self.model, optim.optimizer, optim.scheduler, optim.scaler, params, max_norm, self.where.device)

    @property
    def base_dtype(self) -> torch.dtype:
        """The base checkpoint's dtype: the merged model's."""
        return config_dtype(self.model.config)
