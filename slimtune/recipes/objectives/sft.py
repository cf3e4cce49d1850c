"""Supervised fine-tuning (``training.objective`` sft): the next-token loss on dataset rows, the token mean
over every trained token of the optimizer step (every rank's, counted on the host); evaluation gives the
held-out loss and perplexity. The loop that runs it is ``recipes/finetune.py``'s.

Example: ``run_finetune(load_config("tiny", ["output_dir=out"]))`` (sft is the default objective)"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from slimtune.data import IGNORE_INDEX, model_inputs, rank_batch
from slimtune.distributed import all_sum
from slimtune.lora import lora_parameters
from slimtune.recipes.objective import Objective, StepBatches
from slimtune.recipes.run import Run
from slimtune.recipes.train_loop import no_grad_batches
from slimtune.token_loss import token_loss_sum

log = logging.getLogger(__name__)


class SupervisedObjective(Objective):
    """Next-token cross-entropy over the trained (non -100) labels of SFT rows (packed or not)."""

    @property
    def dropped(self) -> str:
        return f"example(s) have no trained token within max_seq_len={self.cfg.dataset.max_seq_len}; skipped"

    def setup(self, run: Run) -> None:
        log.info(_summary(run))

    def collate(self, run: Run, rows: list, indices: list[int]) -> dict[str, torch.Tensor]:
        return rank_batch(rows, indices, run.where.ranks, run.inputs.pad_id, run.inputs.data.images)

    def prepare_step(self, run: Run, batch: list[list[int]]) -> StepBatches:
        examples = run.inputs.data.train
        micro_batches = [self.collate(run, examples, mb) for mb in batch]  # this rank's slices
        trained, tokens = step_token_counts([examples[i] for mb in batch for i in mb])  # the global step's, on the host
        return StepBatches(micro_batches, tokens, {"trained_tokens": trained})

    def micro_batch_loss(self, model: nn.Module, inputs: dict, step: StepBatches) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**model_inputs(inputs)).logits
        loss = token_loss_sum(logits, inputs["labels"]) / max(1, step.counts["trained_tokens"])
        return loss, loss.new_zeros(0)

    def evaluate(self, run: Run) -> dict:
        """Token-mean loss and perplexity over the held-out examples; sums are all-reduced over the ranks."""
        device, ranks = run.where.device, run.where.ranks
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        for batch, _ in no_grad_batches(run, run.inputs.data.eval, self.collate):
            total += token_loss_sum(run.model(**model_inputs(batch)).logits, batch["labels"]).double()
            count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        total = all_sum(total, ranks).item()
        count = int(all_sum(torch.tensor(float(count), dtype=torch.float64, device=device), ranks).item())
        loss = total / max(1, count)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def step_token_counts(examples: list) -> tuple[int, int]:
    """(trained tokens, tokens) of a global step's examples (every rank's, all micro-batches), counted on
    the host as the collated batches would count them: the loss's denominator and the throughput's
    numerator, the same on every rank without a collective or a read back from the device.

    Example: ``step_token_counts([examples[i] for batch in plan[step] for i in batch])`` -> (1012, 1024)"""
    trained = sum(int((e.labels[1:] != IGNORE_INDEX).sum()) for e in examples)
    return trained, sum(len(e.input_ids) for e in examples)


def _summary(run: Run) -> str:
    """The set-up's one line: model, trainable parameters, device, threads, dtype, ranks, data and steps."""
    cfg, inputs, span, where = run.cfg, run.inputs, run.span, run.where
    data, ranks, threads = inputs.data, where.ranks, where.threads
    trainable = sum(p.numel() for p in lora_parameters(run.model))
    return (
        f"model: {inputs.base.label if inputs.base.hub_id else inputs.base.path.name}, {trainable:,} trainable adapter parameters, "
        f"{where.device.type} "
        f"({threads} CPU thread{'s' if threads > 1 else ''}), "
        f"{str(where.dtype).removeprefix('torch.')}"
        + (f", {ranks.world_size} rank{'s' if ranks.world_size > 1 else ''} (FSDP2)" if ranks.distributed else "")
        + f"; data: {len(data.train)} {'packed rows' if cfg.dataset.packed else 'examples'}"
        + (f" ({data.documents} documents)" if cfg.dataset.packed else "")
        + (f", {len(data.eval)} held out" if data.eval else "")
        + f", {span.steps_per_epoch} steps/epoch, {span.total_steps} steps"
    )
