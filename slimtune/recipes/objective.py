"""The named interface between the one training loop and a training objective: ``Objective``.

The loop (``recipes/finetune.py``, with the micro-batch and evaluation loops of ``recipes/train_loop.py``)
is the same for every objective: the epochs and steps, the optimizer step over the micro-batches, the
non-finite-loss check, evaluation when due, the merged-model figure before a merged save, checkpoints,
logging. What differs is an ``Objective``'s:

- ``dropped``: what the data reader's skipped rows were (one log line after their count);
- ``setup(run)``: its own set-up once the shared one (``run_steps.prepare``) is done, e.g. DPO's reference pass;
- ``collate(run, rows, indices)``: this rank's slice of ``rows[indices]`` as one batch of CPU tensors;
- ``prepare_step(run, batch)``: a global step's micro-batches and counts (``StepBatches``), from the step's
  row indices; an online objective generates here (its micro-batches then hold what it sampled);
- ``micro_batch_loss(model, inputs, step)``: one micro-batch's forward, its share of the step's loss
  (differentiable; the token or pair mean over the whole global step) and the sums of its own figures;
- ``step_metrics(sums, step)``: the step's record entries from the figures summed over micro-batches and ranks;
- ``evaluate(run)``: the held-out figures (``eval_`` prefixed); ``merged_metric`` names the one recorded
  again through the merged model (``<name>_merged``) before a merged save;
- ``figures(run)``: the progress bar's figures beside the loss (None: the last eval loss).

An objective is one module in ``recipes/objectives/`` plus its config section, registered by name in
``recipes/objectives/__init__.py`` (``training.objective`` picks it); docs/training.md shows how.

Example::

    class MyObjective(Objective):
        merged_metric = "eval_loss"
        def collate(self, run, rows, indices): ...
        def prepare_step(self, run, batch): ...
        def micro_batch_loss(self, model, inputs, step): ...
        def evaluate(self, run): ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slimtune.config import Config
from slimtune.recipes.run import Run


@dataclass
class StepBatches:
    """A global step as its objective prepared it: this rank's micro-batches (dicts of CPU tensors, moved
    to the device by the loop), every rank's tokens of the step (the throughput's numerator) and the
    objective's own counts its loss and figures are averaged over (``counts``: e.g. the step's trained tokens)."""

    micro_batches: list[dict[str, Any]]
    tokens: int
    counts: dict[str, Any] = field(default_factory=dict)


class Objective(ABC):
    """What one training objective owns; the loop calls it (see the module's docstring for each part).
    Made once per run from the config (``objective_for``); an objective may keep state across its steps
    (what it puts in ``run.extra_state`` goes into every checkpoint's recipe state)."""

    dropped: ClassVar[str] = "row(s) dropped"  # what the data reader's skipped rows were, after their count
    merged_metric: ClassVar[str] = "eval_loss"  # the eval figure recorded again through the merged model

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self, run: Run) -> None:  # noqa: B027 - optional: most objectives need nothing beyond the shared set-up
        """The objective's own set-up once the shared one is done (a reference pass, a summary line)."""

    @abstractmethod
    def collate(self, run: Run, rows: list, indices: list[int]) -> dict[str, torch.Tensor]:
        """This rank's slice of ``rows[indices]`` as one batch of CPU tensors."""

    @abstractmethod
    def prepare_step(self, run: Run, batch: list[list[int]]) -> StepBatches:
        """A global step's micro-batches (this rank's slices) and counts, from its micro-batches' row indices."""

    @abstractmethod
    def micro_batch_loss(self, model: nn.Module, inputs: dict[str, Any], step: StepBatches) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's share of the step's loss, differentiable; the sums of the objective's figures,
        a 1-D fp32 tensor, detached, empty when it has none), ``inputs`` on the device."""

    def step_metrics(self, sums: torch.Tensor, step: StepBatches) -> dict:
        """The step record's entries from ``sums`` (summed over the micro-batches and ranks, on the host)."""
        return {}

    @abstractmethod
    def evaluate(self, run: Run) -> dict:
        """The held-out figures, ``eval_`` prefixed, computed with no gradient, dropout off and the RNG
        untouched (``train_loop.no_grad_batches``), the same on every rank."""

    def figures(self, run: Run) -> dict | None:
        """The progress bar's figures beside the loss; None: the last eval loss."""
        return None
