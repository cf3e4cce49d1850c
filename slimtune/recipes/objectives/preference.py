"""Preference tuning on the same QLoRA model (``training.objective`` dpo, ipo or simpo): the ``Objective`` the
one loop of ``recipes/finetune.py`` runs, beside SFT's (``objectives/sft.py``).

The reference policy is the model as loaded, before its first step: the NF4 base with fresh adapters
(B = 0: exactly the base with its adapters off) or with ``model.adapter``'s (the SFT adapter training
continues: exactly a frozen copy of it). So ``reference`` is one no-grad pass over every pair, train
and eval, before training (``train_loop.no_grad_batches``: dropout off, no RNG drawn): each pair's summed
answer log-probabilities (chosen, rejected) are kept beside it, and in each checkpoint's recipe state, so
a resumed run reads them back instead of recomputing them (the run's adapters have moved on). No second
model, no copy of an adapter, no reference forward per step. SimPO has no reference: nothing is computed.

Each step's loss is the objective's mean over the global step's pairs (``preference_loss.pair_loss``;
chosen then rejected in one forward, as TRL does); the step's record holds TRL's metric names
(``rewards/accuracies`` ...), evaluation their ``eval_`` versions and, before a merged save,
``eval_rewards/accuracies_merged``: the held-out reward accuracy of round(W' + B A), the merged model.
What a preference config cannot take (packed rows, label smoothing outside simpo, ipo with beta 0) is
refused by the config's ``check`` stage.

Example: ``run_finetune(load_config("llama3.2-1b_dpo", ["model.path=...", "dataset.path=pairs.jsonl"]))``
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from slimtune.data import PreferencePair, model_inputs, rank_pairs
from slimtune.distributed import all_sum, split_rows
from slimtune.errors import SlimtuneError
from slimtune.preference_loss import PreferenceLoss, pair_loss, pair_metric_means, sequence_logps
from slimtune.recipes.objective import Objective, StepBatches
from slimtune.recipes.run import Run
from slimtune.recipes.train_loop import no_grad_batches

log = logging.getLogger(__name__)

REFERENCE_KEY = "reference_logps"  # in recipe_state.pt: {"train": [N, 2], "eval": [M, 2]} fp32


class PreferenceObjective(Objective):
    """DPO (sigmoid), IPO or SimPO on preference pairs, TRL 1.16's losses and metric names
    (``PreferenceLoss.from_config``: training.objective and the preference section)."""

    dropped = "bad pair(s) dropped (preference.bad_rows=drop)"
    merged_metric = "eval_rewards/accuracies"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss_of = PreferenceLoss.from_config(cfg)

    def setup(self, run: Run) -> None:
        """The reference log-probabilities (``reference``), then the set-up's one line."""
        reference(run)
        data, span = run.inputs.data, run.span
        log.info(
            f"preference: {self.cfg.training.objective}, {len(data.train)} pairs"
            + (f", {len(data.eval)} held out" if data.eval else "")
            + f", {span.steps_per_epoch} steps/epoch, {span.total_steps} steps"
        )

    def collate(self, run: Run, rows: list, indices: list[int]) -> dict[str, torch.Tensor]:
        return _pair_batch(run, rows, indices)

    def prepare_step(self, run: Run, batch: list[list[int]]) -> StepBatches:
        pairs = run.inputs.data.train
        chosen_tokens, tokens = _counts([pairs[i] for mb in batch for i in mb])
        micro_batches = [self.collate(run, pairs, mb) for mb in batch]
        return StepBatches(micro_batches, tokens, {"pairs": sum(len(mb) for mb in batch), "chosen_tokens": chosen_tokens})

    def micro_batch_loss(self, model: nn.Module, inputs: dict, step: StepBatches) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**model_inputs(inputs)).logits
        return pair_loss(logits, inputs, self.loss_of, step.counts["pairs"], step.counts["chosen_tokens"])

    def step_metrics(self, sums: torch.Tensor, step: StepBatches) -> dict:
        """TRL's reward and log-probability means over the step's pairs."""
        return pair_metric_means(sums, step.counts["chosen_tokens"], self.loss_of)

    def evaluate(self, run: Run) -> dict:
        """The objective's mean loss and TRL's metric means over the held-out pairs, ``eval_`` prefixed."""
        pairs = run.inputs.data.eval
        chosen_tokens, _ = _counts(pairs)
        totals = torch.zeros(9, dtype=torch.float32, device=run.where.device)
        for inputs, _ in no_grad_batches(run, pairs, self.collate):
            logits = run.model(**model_inputs(inputs)).logits
            loss, sums = pair_loss(logits, inputs, self.loss_of, len(pairs), chosen_tokens)
            totals += torch.cat([loss.reshape(1), sums])
        totals = all_sum(totals, run.where.ranks).cpu()
        means = pair_metric_means(totals[1:], chosen_tokens, self.loss_of, prefix="eval_")
        return {"eval_loss": float(totals[0]), **means, "eval_pairs": len(pairs)}

    def figures(self, run: Run) -> dict:
        """The step's reward accuracy and the last eval's."""
        shown = {"acc": f"{run.record['rewards/accuracies']:.2f}"}
        if run.last_eval and "eval_rewards/accuracies" in run.last_eval:
            shown["eval_acc"] = f"{run.last_eval['eval_rewards/accuracies']:.2f}"
        return shown


def reference(run: Run) -> None:
    """Each pair's reference log-probabilities (chosen, rejected) onto the pair: one no-grad forward of the
    model as loaded (the reference policy), or on resume the checkpoint's; kept in ``run.extra_state`` for
    every checkpoint. SimPO is reference-free: nothing to do.

    Example: ``reference(run)``"""
    if not PreferenceLoss.from_config(run.cfg).uses_reference:
        return
    data = run.inputs.data
    if run.resume is not None:
        saved = run.resume.state.get(REFERENCE_KEY)
        if saved is None or [len(saved["train"]), len(saved["eval"])] != [len(data.train), len(data.eval)]:
            raise SlimtuneError(
                f"cannot resume from {run.resume.path}: its recipe_state.pt holds no reference log-probabilities for these pairs"
            )
        tables = saved
    else:
        started = time.perf_counter()
        tables = {split: _reference_logps(run, pairs) for split, pairs in (("train", data.train), ("eval", data.eval))}
        log.info(f"reference log-probabilities of {len(data.train) + len(data.eval)} pairs: {time.perf_counter() - started:.1f} s")
    for split, pairs in (("train", data.train), ("eval", data.eval)):
        for pair, row in zip(pairs, tables[split].tolist(), strict=True):
            pair.ref_logps = (row[0], row[1])
    run.extra_state[REFERENCE_KEY] = tables


def _counts(pairs: list[PreferencePair]) -> tuple[int, int]:
    """(scored chosen tokens, all tokens of chosen and rejected sequences) of a global step's pairs."""
    chosen = sum(int((p.chosen.labels[1:] >= 0).sum()) for p in pairs)
    return chosen, sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs)


def _pair_batch(run: Run, pairs: list[PreferencePair], indices: list[int]) -> dict[str, torch.Tensor]:
    """This rank's slice of ``pairs[indices]``: chosen then rejected sequences in one batch."""
    return rank_pairs(pairs, indices, run.where.ranks, run.inputs.pad_id)


def _reference_logps(run: Run, pairs: list[PreferencePair]) -> torch.Tensor:
    """[pairs, 2] fp32: each pair's summed chosen and rejected answer log-probabilities under the model;
    under FSDP2 each rank scores its slice and the table is summed over the ranks."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float32, device=run.where.device)
    ranks = run.where.ranks
    for inputs, indices in no_grad_batches(run, pairs, _pair_batch):
        logps, _ = sequence_logps(run.model(**model_inputs(inputs)).logits, inputs["labels"])
        n = logps.shape[0] // 2
        start, end = split_rows(len(indices), ranks.world_size)[ranks.rank]
        if end > start:  # (an empty slice ran one filler pair)
            table[indices[start:end]] = torch.stack([logps[:n], logps[n:]], dim=1)
    return all_sum(table, ranks).cpu()
