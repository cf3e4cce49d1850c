"""Preference tuning on the same QLoRA model (``training.objective`` dpo, ipo or simpo): the steps that are
its own, run by the one loop of ``recipes/finetune.py`` (``run_finetune``) beside the shared steps of
``recipes/steps.py``: ``setup`` (the shared set-up, then ``reference``), ``train_step`` and ``evaluate``.

The reference policy is the model as loaded, before its first step: the NF4 base with fresh adapters
(B = 0: exactly the base with its adapters off) or with ``model.adapter``'s (the SFT adapter training
continues: exactly a frozen copy of it). So ``reference`` is one no-grad forward over every pair, train
and eval, before training, with dropout off and no RNG drawn: each pair's summed answer log-probabilities
(chosen, rejected) are kept beside it, and in each checkpoint's recipe state, so a resumed run reads
them back instead of recomputing them (the run's adapters have moved on). No second model, no copy of
an adapter, no reference forward per step. SimPO has no reference: nothing is computed.

Each step's loss is the objective's mean over the global step's pairs (``preference.pair_loss``; chosen
then rejected in one forward, as TRL does); the step's record holds TRL's metric names
(``rewards/accuracies`` ...), evaluation their ``eval_`` versions and, before a merged save,
``eval_rewards/accuracies_merged``: the held-out reward accuracy of round(W' + B A), the merged model.

Example: ``run_finetune(load_config("llama3.2-1b_dpo", ["model.path=...", "dataset.path=pairs.jsonl"]))``
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn

from slimtune.checkpoint.fidelity import merged_forward
from slimtune.config import Config
from slimtune.data import PreferencePair, model_inputs, rank_pairs
from slimtune.distributed import SINGLE, Ranks, all_sum, reshard, split_rows
from slimtune.errors import SlimtuneError
from slimtune.preference_loss import PreferenceLoss, metric_means, pair_loss, sequence_logps
from slimtune.recipes.run import Run
from slimtune.recipes.steps import merged_dtype, prepare, timed_record
from slimtune.step import StepParts, apply_gradients

log = logging.getLogger(__name__)

REFERENCE_KEY = "reference_logps"  # in recipe_state.pt: {"train": [N, 2], "eval": [M, 2]} fp32


def setup(cfg: Config, ranks: Ranks = SINGLE) -> Run:
    """The shared set-up (run directory, pairs, model, optimizer), then the reference log-probabilities:
    computed from the model as loaded, or on resume read from the checkpoint (``reference``).

    Example: ``run = setup(load_config("tiny", ["output_dir=out", "training.objective=dpo", "dataset.path=pairs.jsonl"]))``"""
    _check_config(cfg)
    run = prepare(cfg, ranks, dropped="bad pair(s) dropped (preference.bad_rows=drop)")
    reference(run)
    data, span = run.inputs.data, run.span
    log.info(
        f"preference: {cfg.training.objective}, {len(data.train)} pairs"
        + (f", {len(data.eval)} held out" if data.eval else "")
        + f", {span.steps_per_epoch} steps/epoch, {span.total_steps} steps"
    )
    return run


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
        tables = {split: _reference_logps(run.model, pairs, run) for split, pairs in (("train", data.train), ("eval", data.eval))}
        log.info(f"reference log-probabilities of {len(data.train) + len(data.eval)} pairs: {time.perf_counter() - started:.1f} s")
    for split, pairs in (("train", data.train), ("eval", data.eval)):
        for pair, row in zip(pairs, tables[split].tolist(), strict=True):
            pair.ref_logps = (row[0], row[1])
    run.extra_state[REFERENCE_KEY] = tables


def train_step(run: Run, batch: list[list[int]]) -> dict:
    """One optimizer step over the global batch ``batch`` (its micro-batches' pair indices): this rank's
    slice of each micro-batch (chosen and rejected in one forward) forward and backward, the loss the
    objective's mean over the step's pairs, then ``apply_gradients``. The record holds the loss, lr,
    tokens/s (chosen + rejected tokens) and TRL's reward and log-probability means over the step's pairs.

    Example: ``record = train_step(run, [[0, 1], [2, 3]])``"""
    cfg, ranks, optim, pairs = run.cfg, run.where.ranks, run.optim, run.inputs.data.train
    started = time.perf_counter()
    loss_of = PreferenceLoss.from_config(cfg)
    step_pairs = [pairs[i] for mb in batch for i in mb]
    chosen_tokens, tokens = _counts(step_pairs)
    lr = optim.optimizer.param_groups[0]["lr"]
    params = [p for g in optim.optimizer.param_groups for p in g["params"]]
    parts = StepParts(
        run.model, optim.optimizer, optim.scheduler, optim.scaler, params, cfg.training.max_grad_norm, run.where.device, run.trim
    )
    device = run.where.device
    totals = torch.zeros(9, dtype=torch.float32, device=device)  # the loss, then pair_loss's sums
    for mb in batch:
        inputs = {k: v.to(device, non_blocking=True) for k, v in rank_pairs(pairs, mb, ranks, run.inputs.pad_id).items()}
        logits = run.model(**model_inputs(inputs)).logits
        loss, sums = pair_loss(logits, inputs, loss_of, len(step_pairs), chosen_tokens)
        del logits
        optim.scaler.scale(loss).backward()
        totals += torch.cat([loss.detach().reshape(1), sums])
        run.trim()  # as step.optimizer_step: what the micro-batch freed goes back to the system
    apply_gradients(parts)
    totals = all_sum(totals, ranks).cpu()  # the step's one host sync
    run.at.global_step += 1
    step_loss = float(totals[0])
    if not math.isfinite(step_loss) and not optim.scaler.is_enabled():
        raise SlimtuneError(f"the loss is {step_loss} at step {run.at.global_step}; lower optimizer.lr or check the data")
    record = timed_record(run, step_loss, lr, tokens, started)
    record.update(metric_means(totals[1:], chosen_tokens, loss_of))
    return record


def evaluate(run: Run, merged: bool = False) -> dict:
    """The objective's loss and TRL's metrics on the held-out pairs, ``eval_`` prefixed (no RNG drawn,
    dropout off); kept as ``run.last_eval``. With ``merged`` (a merged save follows) also
    ``eval_rewards/accuracies_merged``: the same pairs through round(W' + B A) (``merged_forward``; one
    process: not wired under FSDP2 yet).

    Example: ``record.update(evaluate(run))``"""
    run.last_eval = _evaluate(run, run.inputs.data.eval)
    if merged and not run.where.ranks.distributed:
        with merged_forward(run.model, merged_dtype(run)):
            run.last_eval["eval_rewards/accuracies_merged"] = _evaluate(run, run.inputs.data.eval)["eval_rewards/accuracies"]
    return run.last_eval


def progress_figures(run: Run) -> dict:
    """The progress bar's figures beside the loss: the step's reward accuracy and the last eval's."""
    shown = {"acc": f"{run.record['rewards/accuracies']:.2f}"}
    if run.last_eval and "eval_rewards/accuracies" in run.last_eval:
        shown["eval_acc"] = f"{run.last_eval['eval_rewards/accuracies']:.2f}"
    return shown


# the loop's view of this recipe (recipes/finetune.py, ``_steps_of``): setup, train_step, evaluate, the bar's figures
PREFERENCE_STEPS = (setup, train_step, evaluate, progress_figures)


# ---------------------------------------------------------------------------------------------------
# Step helpers


def _check_config(cfg: Config) -> None:
    """What a preference run cannot take, in one line before anything is read."""
    if cfg.dataset.packed:
        raise SlimtuneError("dataset.packed: preference pairs are not packed (each pair's sequences are scored whole); set it false")
    if cfg.preference.label_smoothing and cfg.training.objective != "simpo":
        raise SlimtuneError(
            f"preference.label_smoothing is for simpo (TRL's CPO loss); TRL 1.16's {cfg.training.objective} loss takes none: set it 0"
        )
    if cfg.training.objective == "ipo" and cfg.preference.beta == 0:
        raise SlimtuneError("preference.beta must be above 0 for ipo (the loss holds 1 / (2 beta))")


def _counts(pairs: list[PreferencePair]) -> tuple[int, int]:
    """(scored chosen tokens, all tokens of chosen and rejected sequences) of a global step's pairs."""
    chosen = sum(int((p.chosen.labels[1:] >= 0).sum()) for p in pairs)
    return chosen, sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs)


def _forward_pairs(model: nn.Module, pairs: list[PreferencePair], run: Run):
    """Each batch of ``pairs`` (training.batch_size, this rank's slice) through the model with dropout off,
    no gradient and the RNG forked: yields (collated inputs on the device, logits, this slice's indices)."""
    device, ranks, size = run.where.device, run.where.ranks, run.cfg.training.batch_size
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for start in range(0, len(pairs), size):
            indices = list(range(start, min(start + size, len(pairs))))
            inputs = {k: v.to(device) for k, v in rank_pairs(pairs, indices, ranks, run.inputs.pad_id).items()}
            yield inputs, model(**model_inputs(inputs)).logits, indices
    model.train(was_training)
    reshard(model)


def _reference_logps(model: nn.Module, pairs: list[PreferencePair], run: Run) -> torch.Tensor:
    """[pairs, 2] fp32: each pair's summed chosen and rejected answer log-probabilities under ``model``;
    under FSDP2 each rank scores its slice and the table is summed over the ranks."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float32, device=run.where.device)
    ranks = run.where.ranks
    for inputs, logits, indices in _forward_pairs(model, pairs, run):
        logps, _ = sequence_logps(logits, inputs["labels"])
        n = logps.shape[0] // 2
        start, end = split_rows(len(indices), ranks.world_size)[ranks.rank]
        if end > start:  # (an empty slice ran one filler pair)
            table[indices[start:end]] = torch.stack([logps[:n], logps[n:]], dim=1)
    return all_sum(table, ranks).cpu()


def _evaluate(run: Run, pairs: list[PreferencePair]) -> dict:
    """The objective's mean loss and TRL's metric means over ``pairs``, ``eval_`` prefixed."""
    loss_of = PreferenceLoss.from_config(run.cfg)
    chosen_tokens, _ = _counts(pairs)
    device = run.where.device
    totals = torch.zeros(9, dtype=torch.float32, device=device)
    for inputs, logits, _ in _forward_pairs(run.model, pairs, run):
        loss, sums = pair_loss(logits, inputs, loss_of, len(pairs), chosen_tokens)
        totals += torch.cat([loss.reshape(1), sums])
    totals = all_sum(totals, run.where.ranks).cpu()
    return {"eval_loss": float(totals[0]), **metric_means(totals[1:], chosen_tokens, loss_of, prefix="eval_"), "eval_pairs": len(pairs)}
