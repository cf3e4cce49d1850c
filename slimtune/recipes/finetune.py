"""QLoRA fine-tuning on a local JSONL dataset: `slimtune finetune --config NAME_OR_PATH [key=value ...]`.

Read top to bottom as named steps: ``run_finetune`` calls ``setup`` (checks, data, model, optimizer: a
``Run``), ``restore`` (a fresh output_dir, or the state of the checkpoint it resumes from), then for each
optimizer step ``train_step``, ``evaluate`` when due and ``save_step`` when due, ``log_step``, and
``finish``. This file holds what is supervised fine-tuning's own (its data, its step, its evaluation);
the steps any recipe shares are ``recipes/steps.py``'s, what a run holds ``recipes/run.py``'s.

One process or many: under torchrun (``torchrun --nproc-per-node N -m slimtune finetune ...``, or
``slimtune finetune --nproc N``) every rank runs this same code. The model is loaded FSDP2-sharded
(each rank reads every tensor and keeps its rows, ``load_qlora_model``); each rank takes its
contiguous slice of every global micro-batch (the same global batches as one process, from seed and
epoch); the loss is the token mean over the whole global step (trained-token counts all-reduced,
gradients summed over the ranks), so 1 and N ranks follow the same curve up to reduction order. The
coordinator (rank 0) logs and writes the run directory's own files; checkpoints are written by
every rank together (its rows of the merged model, its shards of the training state through DCP).

Set-up checks everything cheap before anything slow or anything written: the config (already
validated), what output_dir holds (resume point and its compatibility), the data (parsed and
tokenized), then loads the model as NF4 + LoRA. Training is AdamW on the adapters only, linear warmup
then cosine decay, gradient accumulation with the loss averaged over every trained token of the
optimizer step, gradient clipping. Checkpoints (``step-NNNNNN``) are written by ``save_checkpoint`` in
bounded memory and atomically. Inside them ``recipe_state.pt`` holds the run's facts resume checks first
(step, config, data hash) and ``train_state/`` (torch.distributed.checkpoint, every rank its shards) the
training state: adapters, optimizer, scheduler, loss scaler, data position, each rank's RNG states
(``checkpoint/run_state.py``). So ``resume=true`` continues bit-exactly where a checkpoint was taken, in
a new process, on the same number of ranks (on another number, it continues through DCP's resharding).
The run directory itself (step directories, resume point, pruning, leftovers, metrics.jsonl) belongs to
``CheckpointManager``. Progress lines go to the ``slimtune`` logger (the CLI prints them).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from slimtune.checkpoint.fidelity import merged_forward
from slimtune.checkpoint.manager import CreatedByRun
from slimtune.config import Config
from slimtune.data import IGNORE_INDEX, epoch_order, epoch_steps, model_inputs, rank_batch
from slimtune.distributed import SINGLE, Ranks, all_sum, init_distributed, reshard
from slimtune.errors import SlimtuneError
from slimtune.lora import lora_parameters
from slimtune.model import pick_device
from slimtune.recipes.preference import PREFERENCE_STEPS
from slimtune.recipes.run import FinetuneResult, Placement, Run
from slimtune.recipes.steps import (
    adapter_only,
    every,
    finish,
    log_step,
    merged_dtype,
    needs_tiny_base,
    prepare,
    restore,
    save_step,
    timed_record,
)
from slimtune.step import StepParts, optimizer_step, step_token_counts, token_loss_sum

log = logging.getLogger(__name__)


def run_finetune(cfg: Config, on_step: Callable[[dict], None] | None = None) -> FinetuneResult:
    """Train LoRA adapters on a QLoRA model as ``cfg`` says; ``on_step`` sees each step's metrics record.
    Under torchrun every rank calls this (it joins the process group). A fresh run that fails before its
    first checkpoint leaves nothing behind (CreatedByRun).

    Example: ``run_finetune(load_config("tiny", ["output_dir=out", "training.max_steps=5"]))``"""
    ranks = init_distributed(pick_device(cfg.device).type)
    made = [Path(cfg.model.path)] if needs_tiny_base(cfg) else []
    created = CreatedByRun(Path(cfg.output_dir), [*made, Path(cfg.dataset.path)]) if ranks.is_coordinator else None
    try:
        setup_run, step, evaluate_run, figures = _steps_of(cfg.training.objective)
        run = setup_run(cfg, ranks)
        restore(run)
        at = run.at
        while at.global_step < run.span.stop_at:
            steps = epoch_steps(
                epoch_order(len(run.inputs.data.train), cfg.seed, at.epoch, cfg.dataset.shuffle),
                cfg.training.batch_size,
                cfg.training.gradient_accumulation_steps,
            )
            for index in range(at.step_in_epoch, len(steps)):
                epoch_end = index + 1 == len(steps)
                at.position = (at.epoch + 1, 0) if epoch_end else (at.epoch, index + 1)
                record = step(run, steps[index])
                # a checkpoint at each epoch end, every save_every_n_steps and where this invocation stops
                save_now = epoch_end or every(at.global_step, cfg.checkpoint.save_every_n_steps) or at.global_step == run.span.stop_at
                if run.inputs.data.eval and (save_now or every(at.global_step, cfg.training.eval_every_n_steps)):
                    record.update(evaluate_run(run, merged=save_now and not adapter_only(run)))
                if save_now:
                    save_step(run)
                log_step(run, on_step, shown=figures(run))
                if at.global_step >= run.span.stop_at:
                    break
            at.epoch, at.step_in_epoch = at.position
        return finish(run)
    except BaseException:
        if created is not None:
            created.undo()
        raise


def _steps_of(objective: str) -> tuple[Callable, Callable, Callable, Callable]:
    """The recipe's own steps for training.objective: (setup, train_step, evaluate, the progress bar's
    figures); sft's are this file's, the preference objectives' ``recipes/preference.py``'s."""
    if objective == "sft":
        return setup, train_step, evaluate, lambda run: None
    return PREFERENCE_STEPS


# ---------------------------------------------------------------------------------------------------
# The steps of supervised fine-tuning (the shared ones: recipes/steps.py)


def setup(cfg: Config, ranks: Ranks = SINGLE) -> Run:
    """Check everything cheap before anything slow or anything written: output_dir (resume point and its
    compatibility), tokenizer and data (parsed and tokenized row by row: a bad row fails in seconds),
    then load the model (NF4 base + fp32 adapters, FSDP2-sharded under a process group) and make the
    optimizer (AdamW on the adapters), the warmup + cosine schedule and the loss scaler (fp16 only).
    Writes nothing but the embedded tiny model, when the config asks for it and the data is good.

    Example: ``run = setup(load_config("tiny", ["output_dir=out"]))``"""
    run = prepare(cfg, ranks, dropped=f"example(s) have no trained token within max_seq_len={cfg.dataset.max_seq_len}; skipped")
    log.info(_summary(run))
    return run


def train_step(run: Run, batch: list[list[int]]) -> dict:
    """One optimizer step over the global batch ``batch`` (its micro-batches' example indices): this
    rank's slice of each micro-batch forward and backward, the loss the token mean over the whole global
    step, gradient clipping, optimizer and scheduler steps. Returns the step's metrics record (also
    ``run.record``, which evaluation and the checkpoint add to).

    Example: ``record = train_step(run, [[0, 1], [2, 3]])``"""
    cfg, ranks, optim, examples = run.cfg, run.where.ranks, run.optim, run.inputs.data.train
    started = time.perf_counter()
    micro_batches = [rank_batch(examples, mb, ranks, run.inputs.pad_id) for mb in batch]  # this rank's slices
    trained_tokens, tokens = step_token_counts([examples[i] for mb in batch for i in mb])  # the global step's, on the host
    lr = optim.optimizer.param_groups[0]["lr"]
    params = [p for g in optim.optimizer.param_groups for p in g["params"]]
    parts = StepParts(
        run.model, optim.optimizer, optim.scheduler, optim.scaler, params, cfg.training.max_grad_norm, run.where.device, run.trim
    )
    step_loss = all_sum(optimizer_step(parts, micro_batches, trained_tokens), ranks).item()  # the step's one host sync
    run.at.global_step += 1
    if not math.isfinite(step_loss) and not optim.scaler.is_enabled():
        raise SlimtuneError(f"the loss is {step_loss} at step {run.at.global_step}; lower optimizer.lr or check the data")
    return timed_record(run, step_loss, lr, tokens, started)


def evaluate(run: Run, merged: bool = False) -> dict:
    """Loss and perplexity on the held-out examples (``_evaluate``: no RNG drawn, dropout off); kept as
    ``run.last_eval`` for the checkpoint's model card and the summary. With ``merged`` (a merged save
    follows) also ``eval_loss_merged``: the same data through round(W' + B A), what the merge's one
    rounding costs (``merged_forward``; one process: not wired under FSDP2 yet).

    Example: ``record.update(evaluate(run))``"""
    args = (run.inputs.data.eval, run.cfg.training.batch_size, run.inputs.pad_id, run.where)
    run.last_eval = _evaluate(run.model, *args)
    if merged and not run.where.ranks.distributed:
        with merged_forward(run.model, merged_dtype(run)):
            run.last_eval["eval_loss_merged"] = _evaluate(run.model, *args)["eval_loss"]
    return run.last_eval


# ---------------------------------------------------------------------------------------------------
# Step helpers


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


def _evaluate(model: nn.Module, examples: list, batch_size: int, pad_id: int, where: Placement) -> dict:
    """Token-mean loss and perplexity over ``examples``: dropout off, no gradient, and the RNG state
    forked around it, so training continues exactly as without evaluation. Each rank evaluates its
    slice of every batch (``rank_batch``: every rank runs each forward FSDP2 needs); sums are all-reduced."""
    device, ranks = where.device, where.ranks
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for start in range(0, len(examples), batch_size):
            indices = list(range(start, min(start + batch_size, len(examples))))
            batch = {k: v.to(device) for k, v in rank_batch(examples, indices, ranks, pad_id).items()}
            total += token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"]).double()
            count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model.train(was_training)
    reshard(model)
    total = all_sum(total, ranks).item()
    count = int(all_sum(torch.tensor(float(count), dtype=torch.float64, device=device), ranks).item())
    loss = total / max(1, count)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}
