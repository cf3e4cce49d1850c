"""QLoRA fine-tuning on a local dataset, the one training loop of every objective:
`slimtune finetune --config NAME_OR_PATH [key=value ...]`.

Read top to bottom as named steps: ``run_finetune`` calls ``setup`` (checks, data, model, optimizer and
the objective's own set-up: a ``Run``), ``restore`` (a fresh output_dir, or the state of the checkpoint it
resumes from), then for each optimizer step ``train_step``, ``evaluate`` when due and ``save_step`` when
due, ``log_step``, and ``finish``. What differs between objectives (SFT, DPO/IPO/SimPO: how rows are
batched, the loss, the evaluation, the progress bar's figures) is the run's ``Objective``
(``recipes/objective.py``; one module each in ``recipes/objectives/``, picked by training.objective). The
micro-batch and evaluation loops are ``recipes/train_loop.py``'s, the set-up, save and logging steps
``recipes/run_steps.py``'s, what a run holds ``recipes/run.py``'s.

One process or many: under torchrun (``torchrun --nproc-per-node N -m slimtune finetune ...``, or
``slimtune finetune --nproc N``) every rank runs this same code. The model is loaded FSDP2-sharded
(each rank reads every tensor and keeps its rows, ``load_qlora_model``); each rank takes its
contiguous slice of every global micro-batch (the same global batches as one process, from seed and
epoch); the loss is the objective's mean over the whole global step (counted on the host, gradients
summed over the ranks), so 1 and N ranks follow the same curve up to reduction order. The
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
import time
from collections.abc import Callable
from pathlib import Path

from slimtune.checkpoint.fidelity import merged_forward
from slimtune.checkpoint.manager import CreatedByRun
from slimtune.config import Config
from slimtune.data import epoch_order, epoch_steps
from slimtune.distributed import SINGLE, Ranks, all_sum, init_distributed
from slimtune.model import pick_device
from slimtune.recipes.objectives import objective_for
from slimtune.recipes.run import FinetuneResult, Run
from slimtune.recipes.run_steps import (
    adapter_only,
    every,
    finish,
    log_step,
    merged_dtype,
    needs_tiny_base,
    prepare,
    restore,
    save_step,
)
from slimtune.recipes.train_loop import check_finite, optimizer_step

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
        run = setup(cfg, ranks)
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
                record = train_step(run, steps[index])
                # a checkpoint at each epoch end, every save_every_n_steps and where this invocation stops
                save_now = epoch_end or every(at.global_step, cfg.checkpoint.save_every_n_steps) or at.global_step == run.span.stop_at
                if run.inputs.data.eval and (save_now or every(at.global_step, cfg.training.eval_every_n_steps)):
                    record.update(evaluate(run, merged=save_now and not adapter_only(run)))
                if save_now:
                    save_step(run)
                log_step(run, on_step, shown=run.objective.figures(run))
                if at.global_step >= run.span.stop_at:
                    break
            at.epoch, at.step_in_epoch = at.position
        return finish(run)
    except BaseException:
        if created is not None:
            created.undo()
        raise


# ---------------------------------------------------------------------------------------------------
# The steps of every objective (the shared set-up, restore, save and logging: recipes/run_steps.py)


def setup(cfg: Config, ranks: Ranks = SINGLE) -> Run:
    """Check everything cheap before anything slow or anything written: output_dir (resume point and its
    compatibility), tokenizer and data (parsed and tokenized row by row: a bad row fails in seconds),
    then load the model (NF4 base + fp32 adapters, FSDP2-sharded under a process group) and make the
    optimizer (AdamW on the adapters), the warmup + cosine schedule and the loss scaler (fp16 only);
    then the objective's own set-up (training.objective: ``objective_for``; DPO's reference pass).
    Writes nothing but the embedded tiny model, when the config asks for it and the data is good.

    Example: ``run = setup(load_config("tiny", ["output_dir=out"]))``"""
    objective = objective_for(cfg)
    run = prepare(cfg, ranks, dropped=objective.dropped)
    run.objective = objective
    objective.setup(run)
    return run


def train_step(run: Run, batch: list[list[int]]) -> dict:
    """One optimizer step over the global batch ``batch`` (its micro-batches' row indices): the objective
    prepares this rank's slice of each micro-batch, ``optimizer_step`` runs their forward and backward
    (the loss the objective's mean over the whole global step), clipping, optimizer and scheduler steps.
    Returns the step's metrics record (also ``run.record``, which evaluation and the checkpoint add to):
    loss, lr, tokens/s and the objective's own figures.

    Example: ``record = train_step(run, [[0, 1], [2, 3]])``"""
    objective, started = run.objective, time.perf_counter()
    step = objective.prepare_step(run, batch)
    lr = run.parts.optimizer.param_groups[0]["lr"]
    totals = all_sum(optimizer_step(run.parts, objective, step), run.where.ranks).cpu()  # the step's one host sync
    run.at.global_step += 1
    step_loss = float(totals[0])
    check_finite(run, step_loss)
    record = timed_record(run, step_loss, lr, step.tokens, started)
    record.update(objective.step_metrics(totals[1:], step))
    return record


def evaluate(run: Run, merged: bool = False) -> dict:
    """The objective's held-out figures (SFT: loss and perplexity; preference: TRL's metrics), with no
    RNG drawn and dropout off; kept as ``run.last_eval`` for the checkpoint's model card and the summary.
    With ``merged`` (a merged save follows) also the objective's ``merged_metric`` through
    round(W' + B A), ``<name>_merged``: what the merge's one rounding costs (``merged_forward``; one
    process: not wired under FSDP2 yet).

    Example: ``record.update(evaluate(run))``"""
    objective = run.objective
    run.last_eval = objective.evaluate(run)
    if merged and not run.where.ranks.distributed:
        with merged_forward(run.model, merged_dtype(run)):
            run.last_eval[f"{objective.merged_metric}_merged"] = objective.evaluate(run)[objective.merged_metric]
    return run.last_eval


# ---------------------------------------------------------------------------------------------------
# Step helpers


def timed_record(run: Run, loss: float, lr: float, tokens: int, started: float) -> dict:
    """The step's metrics record (also ``run.record``, which evaluation and the checkpoint add to): step,
    epoch, loss, lr, tokens/s and step seconds since ``started``, and where this invocation resumed.

    Example: ``record = timed_record(run, step_loss, lr, tokens, started)``"""
    seconds = time.perf_counter() - started
    run.record = {"step": run.at.global_step, "epoch": run.at.epoch + 1, "loss": loss, "lr": lr}
    run.record.update(tokens_per_s=tokens / seconds, step_s=seconds)
    if run.at.global_step == run.at.first_step and run.resume is not None:
        run.record["resumed_from"] = run.resume.state["global_step"]
    if run.at.global_step == run.at.first_step and run.cfg.training.compile:
        log.info(f"compile: cold start, the first step (compiling the decoder layer) took {seconds:.1f} s")
    return run.record
