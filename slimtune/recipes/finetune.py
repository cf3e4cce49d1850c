"""QLoRA fine-tuning on a local JSONL dataset: `slimtune finetune --config NAME_OR_PATH [key=value ...]`.

Read top to bottom as named steps: ``run_finetune`` calls ``setup`` (checks, data, model, optimizer: a
``Run``), ``restore`` (a fresh output_dir, or the state of the checkpoint it resumes from), then for each
optimizer step ``train_step``, ``evaluate`` when due and ``checkpoint`` when due, and ``finish``. The
helpers below the steps follow in the order the steps use them.

One process or many: under torchrun (``torchrun --nproc-per-node N -m slimtune finetune ...``, or
``slimtune finetune --nproc N``) every rank runs this same code. The model is loaded FSDP2-sharded
(each rank reads every tensor and keeps its rows, ``load_qlora_model``); each rank takes its
contiguous slice of every global micro-batch (the same global batches as one process, from seed and
epoch); the loss is the token mean over the whole global step (trained-token counts all-reduced,
gradients summed over the ranks), so 1 and N ranks follow the same curve up to reduction order. The
coordinator (rank 0) prints and writes the run directory's own files; checkpoints are written by
every rank together (its rows of the merged model, its shards of the training state through DCP).

Set-up checks everything cheap before anything slow or anything written: the config (already
validated), what output_dir holds (resume point and its compatibility), the data (parsed and
tokenized), then loads the model as NF4 + LoRA. Training is AdamW on the adapters only, linear warmup
then cosine decay, gradient accumulation with the loss averaged over every trained token of the
optimizer step, gradient clipping. Checkpoints (``step-NNNNNN``) are written by ``save_checkpoint`` in
bounded memory and atomically. Inside them ``recipe_state.pt`` holds the run's facts resume checks first
(step, config, data hash) and ``train_state/`` (torch.distributed.checkpoint, every rank its shards) the
training state: adapters, optimizer, scheduler, loss scaler, data position, each rank's RNG states. So
``resume=true`` continues bit-exactly where a checkpoint was taken, in a new process, on the same number
of ranks (on another number, it continues through DCP's resharding). The run directory itself (step
directories, resume point, pruning, leftovers, metrics.jsonl) belongs to ``CheckpointManager``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from tqdm.auto import tqdm

from slimtune.card import CardFacts, model_card
from slimtune.checkpoint.background import BackgroundSaver, WriterSpec
from slimtune.checkpoint.fidelity import merged_forward
from slimtune.checkpoint.manager import STATE_FORMAT, CheckpointManager, CreatedByRun, ResumePoint
from slimtune.checkpoint.save import ADAPTER_DIR, SaveOptions, SaveResult
from slimtune.checkpoint.train_state import load_train_state, rng_state, set_rng_state
from slimtune.checkpoint.writer import WriteOptions
from slimtune.config import Config
from slimtune.data import (
    FALLBACK_CHAT_TEMPLATE,
    IGNORE_INDEX,
    Data,
    DataSpec,
    builtin_tiny_records,
    collate,
    epoch_order,
    epoch_steps,
    load_data,
    model_inputs,
    write_jsonl,
)
from slimtune.distributed import SINGLE, Ranks, init_distributed, reshard, split_rows
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.fileio import os_errors, write_atomic
from slimtune.formats.hf import load_config as load_hf_config
from slimtune.formats.hf import tokenizer_files
from slimtune.generate import FORMAT_NAME, Loaded, SamplingOptions, format_record, generate, prompt_format_of, prompt_ids
from slimtune.gguf_export import export_checkpoint_gguf
from slimtune.lora import LoRAConfig, lora_parameters
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import config_dtype, load_qlora_model, load_tokenizer, nf4_report, nf4_summary_line, pick_device, pick_dtype
from slimtune.runtime import choose_num_threads, compile_decoder_layers
from slimtune.step import StepParts, optimizer_step, step_token_counts, token_loss_sum
from slimtune.tensors import DTYPES
from slimtune.tiny import byte_tokenizer, make_tiny_checkpoint, tiny_config
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


@dataclass
class Run:
    """Everything a run holds between its steps: made by ``setup``, advanced by the other steps."""

    cfg: Config
    ranks: Ranks
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    manager: CheckpointManager
    resume: ResumePoint | None  # None: a fresh start
    tokenizer: object
    hf_config: object
    data: Data
    builtin_rows: list[dict] | None  # the built-in dataset, written by ``restore``
    model: nn.Module
    base_dtype: torch.dtype  # the base checkpoint's dtype: the merged model's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    lr_factor: Callable[[int], float]
    pad_id: int
    total_steps: int
    stop_at: int  # where this invocation stops (training.stop_after_steps)
    steps_per_epoch: int
    global_step: int = 0
    epoch: int = 0  # 0-based
    step_in_epoch: int = 0  # the next step of the epoch, 0-based
    position: tuple[int, int] = (0, 0)  # (epoch, step_in_epoch) after the step being taken
    first_step: int = 1  # this invocation's first step
    record: dict = field(default_factory=dict)  # the metrics record of the step being taken
    last_eval: dict | None = None
    docs: CheckpointDocs | None = None
    metrics: MetricsLog | None = None
    trackers: Trackers = field(default_factory=Trackers)
    memory: PeakMemory | None = None
    bar: tqdm | None = None
    result: FinetuneResult | None = None
    saver: BackgroundSaver | None = None  # checkpoint.async: the background writer


def run_finetune(cfg: Config, on_step: Callable[[dict], None] | None = None) -> FinetuneResult:
    """Train LoRA adapters on a QLoRA model as ``cfg`` says; ``on_step`` sees each step's metrics record.
    Under torchrun every rank calls this (it joins the process group). A fresh run that fails before its
    first checkpoint leaves nothing behind (CreatedByRun).

    Example: ``run_finetune(load_config("tiny", ["output_dir=out", "training.max_steps=5"]))``"""
    ranks = init_distributed(pick_device(cfg.device).type)
    created = CreatedByRun(Path(cfg.output_dir), [Path(cfg.model.path), Path(cfg.dataset.path)]) if ranks.is_coordinator else None
    try:
        run = setup(cfg, ranks)
        restore(run)
        while run.global_step < run.stop_at:
            steps = epoch_steps(
                epoch_order(len(run.data.train), cfg.seed, run.epoch, cfg.dataset.shuffle),
                cfg.training.batch_size,
                cfg.training.gradient_accumulation_steps,
            )
            for index in range(run.step_in_epoch, len(steps)):
                epoch_end = index + 1 == len(steps)
                run.position = (run.epoch + 1, 0) if epoch_end else (run.epoch, index + 1)
                record = train_step(run, steps[index])
                # a checkpoint at each epoch end, every save_every_n_steps and where this invocation stops
                save_now = epoch_end or _every(run.global_step, cfg.checkpoint.save_every_n_steps) or run.global_step == run.stop_at
                if run.data.eval and (save_now or _every(run.global_step, cfg.training.eval_every_n_steps)):
                    record.update(evaluate(run, merged=save_now and not _adapter_only(run)))
                if save_now:
                    checkpoint(run)
                log_step(run, on_step)
                if run.global_step >= run.stop_at:
                    break
            run.epoch, run.step_in_epoch = run.position
        return finish(run)
    except BaseException:
        if created is not None:
            created.undo(say)
        raise


# ---------------------------------------------------------------------------------------------------
# The steps


def setup(cfg: Config, ranks: Ranks = SINGLE) -> Run:
    """Check everything cheap before anything slow or anything written: output_dir (resume point and its
    compatibility), tokenizer and data (parsed and tokenized row by row: a bad row fails in seconds),
    then load the model (NF4 base + fp32 adapters, FSDP2-sharded under a process group) and make the
    optimizer (AdamW on the adapters), the warmup + cosine schedule and the loss scaler (fp16 only).
    Writes nothing but the embedded tiny model, when the config asks for it and the data is good.

    Example: ``run = setup(load_config("tiny", ["output_dir=out"]))``"""
    device = pick_device(cfg.device)
    if device.type == "cuda" and ranks.distributed:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed bound this rank to its GPU
    dtype = pick_dtype(cfg.dtype, device)
    if ranks.distributed and dtype == torch.float16:
        raise SlimtuneError("dtype fp16 (loss scaling) is for one process; with several ranks use bf16 or fp32")
    threads = choose_num_threads(cfg.training.num_threads)
    manager = CheckpointManager(Path(cfg.output_dir), cfg.checkpoint.keep_last_n, log=say)
    resume = manager.find_resume_point(cfg.resume, cfg.overwrite)  # or refuse to mix two runs
    if resume is not None:
        manager.check_resumable(cfg, resume)
    tokenizer, hf_config, data, builtin_rows = _read_data(cfg, ranks, resume)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    steps_per_epoch = len(epoch_steps(list(range(len(data.train))), cfg.training.batch_size, cfg.training.gradient_accumulation_steps))
    total_steps = cfg.training.total_epochs * steps_per_epoch
    if cfg.training.max_steps is not None:
        total_steps = min(total_steps, cfg.training.max_steps)
    model = _load_model(cfg, ranks, device, dtype)
    params = lora_parameters(model)
    say(
        f"model: {Path(cfg.model.path).name}, {sum(p.numel() for p in params):,} trainable adapter parameters, {device.type} "
        f"({threads} CPU thread{'s' if threads > 1 else ''}), "
        f"{str(dtype).removeprefix('torch.')}"
        + (f", {ranks.world_size} rank{'s' if ranks.world_size > 1 else ''} (FSDP2)" if ranks.distributed else "")
        + f"; data: {len(data.train)} {'packed rows' if cfg.dataset.packed else 'examples'}"
        + (f" ({data.documents} documents)" if cfg.dataset.packed else "")
        + (f", {len(data.eval)} held out" if data.eval else "")
        + f", {steps_per_epoch} steps/epoch, {total_steps} steps"
    )
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    lr_factor = partial(warmup_cosine, warmup=cfg.scheduler.warmup_steps, total=total_steps, min_ratio=cfg.scheduler.min_lr_ratio)
    stop_at = total_steps if cfg.training.stop_after_steps is None else min(total_steps, cfg.training.stop_after_steps)
    return Run(
        cfg,
        ranks,
        device,
        dtype,
        manager,
        resume,
        tokenizer,
        hf_config,
        data,
        builtin_rows,
        model,
        base_dtype=config_dtype(model.config),
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor),
        scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        lr_factor=lr_factor,
        pad_id=pad_id,
        total_steps=total_steps,
        stop_at=stop_at,
        steps_per_epoch=steps_per_epoch,
    )


def restore(run: Run) -> None:
    """Where writing starts: a fresh output_dir (leftovers removed, the previous run's files with
    overwrite, the built-in dataset written), or everything restored from the checkpoint resumed from
    (adapters, optimizer, scheduler, loss scaler, data position, RNG: ``_load_train_state``). Then the
    run's logs open: metrics.jsonl (cut back to the checkpoint's step), trackers, progress bar."""
    cfg, ranks = run.cfg, run.ranks
    error = None
    if ranks.is_coordinator:
        try:
            run.manager.prepare(fresh_start=run.resume is None, overwrite=cfg.overwrite)
            if run.builtin_rows is not None:
                with os_errors("write the built-in dataset to", Path(cfg.dataset.path)):
                    write_jsonl(Path(cfg.dataset.path), run.builtin_rows)
                say(f"built-in dataset written to {cfg.dataset.path}")
        except BaseException as e:  # noqa: BLE001 - every rank raises below
            error = e
    ranks.agree(error, "preparing output_dir")
    if run.resume is None:
        seed_everything(cfg.seed + ranks.rank)
    else:
        _load_train_state(run)
    run.position, run.first_step = (run.epoch, run.step_in_epoch), run.global_step + 1
    run.docs = CheckpointDocs(run.tokenizer, cfg, run.data, run.hf_config, _merged_dtype(run) or run.base_dtype, nf4_report(run.model))
    if ranks.is_coordinator:
        last_record = run.resume.state.get("metrics") if run.resume is not None else None
        run.metrics = MetricsLog(run.manager.metrics_path, keep_through_step=run.global_step, last_record=last_record)
        run.trackers = Trackers.from_config(cfg, run.manager.out, resume_step=run.global_step)
    if cfg.checkpoint.async_ and _saves_before_the_end(run):  # on a GPU / under torchrun its writers load now
        spec = WriterSpec(Path(cfg.model.path), _lora_config(cfg), cfg.seed, run.dtype)
        run.saver = BackgroundSaver(spec, run.manager, say, ranks=ranks, model=run.model)
    run.memory = PeakMemory(run.device)
    run.result = FinetuneResult(run.model, run.tokenizer, run.manager.out, run.global_step, metrics_path=run.manager.metrics_path)
    if run.global_step >= run.stop_at:
        say(f"nothing to train: the run is at step {run.global_step} and stops at step {run.stop_at}")
    run.model.train()
    progress = cfg.logging.progress_bar and ranks.is_coordinator
    run.bar = tqdm(total=run.total_steps, initial=run.global_step, desc="train", unit="step", dynamic_ncols=True, disable=not progress)


def train_step(run: Run, batch: list[list[int]]) -> dict:
    """One optimizer step over the global batch ``batch`` (its micro-batches' example indices): this
    rank's slice of each micro-batch forward and backward, the loss the token mean over the whole global
    step, gradient clipping, optimizer and scheduler steps. Returns the step's metrics record (also
    ``run.record``, which evaluation and the checkpoint add to)."""
    cfg, ranks, scaler, optimizer = run.cfg, run.ranks, run.scaler, run.optimizer
    started = time.perf_counter()
    micro_batches = [rank_batch(run.data.train, mb, ranks, run.pad_id) for mb in batch]  # this rank's slices
    trained_tokens, tokens = step_token_counts([run.data.train[i] for mb in batch for i in mb])  # the global step's, on the host
    lr = optimizer.param_groups[0]["lr"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    parts = StepParts(run.model, optimizer, run.scheduler, scaler, params, cfg.training.max_grad_norm, run.device)
    step_loss = all_sum(optimizer_step(parts, micro_batches, trained_tokens), ranks).item()  # the step's one host sync
    run.global_step += 1
    if not math.isfinite(step_loss) and not scaler.is_enabled():
        raise SlimtuneError(f"the loss is {step_loss} at step {run.global_step}; lower optimizer.lr or check the data")
    seconds = time.perf_counter() - started
    run.record = {"step": run.global_step, "epoch": run.epoch + 1, "loss": step_loss, "lr": lr}
    run.record.update(tokens_per_s=tokens / seconds, step_s=seconds)
    if run.global_step == run.first_step and run.resume is not None:
        run.record["resumed_from"] = run.resume.state["global_step"]
    if run.global_step == run.first_step and cfg.training.compile:
        say(f"compile: cold start, the first step (compiling the decoder layer) took {seconds:.1f} s")
    return run.record


def evaluate(run: Run, merged: bool = False) -> dict:
    """Loss and perplexity on the held-out examples (``_evaluate``: no RNG drawn, dropout off); kept as
    ``run.last_eval`` for the checkpoint's model card and the summary. With ``merged`` (a merged save
    follows) also ``eval_loss_merged``: the same data through round(W' + B A), what the merge's one
    rounding costs (``merged_forward``; one process: not wired under FSDP2 yet)."""
    args = (run.data.eval, run.cfg.training.batch_size, run.pad_id, run.device, run.ranks)
    run.last_eval = _evaluate(run.model, *args)
    if merged and not run.ranks.distributed:
        with merged_forward(run.model, _merged_dtype(run)):
            run.last_eval["eval_loss_merged"] = _evaluate(run.model, *args)["eval_loss"]
    return run.last_eval


def checkpoint(run: Run) -> SaveResult | None:
    """Samples (training.sample_prompts) into the step's record, then ``step-N`` through the manager,
    written by every rank: the merged model (unless checkpoint.merged says adapter only), the adapter,
    tokenizer, model card, recipe state and training state; then pruning (keep_last_n). With
    checkpoint.async the background writers write it (one per rank, the same cooperative save): this
    step blocks only for the snapshot (``checkpoint_stall_s``) and returns None; ``log_step`` reports the
    save when every rank's writer has finished it."""
    cfg, ranks, record, step = run.cfg, run.ranks, run.record, run.global_step
    if cfg.training.sample_prompts:
        record["samples"] = _sample_generations(run)
        for sample in record["samples"]:
            say(f"sample at step {step}: {sample['prompt']!r} -> {sample['text']!r}")  # every rank ran it: FSDP2 needs all
    ckpt = run.manager.step_path(step)
    state = recipe_state(cfg, step, run.data.sha256, len(run.data.train), run.total_steps, ranks)
    state["metrics"] = {**record, "checkpoint": ckpt.name}  # rewritten on resume if a kill takes it
    adapter_only = _adapter_only(run)
    facts = dict(step=step, total_steps=run.total_steps, epoch=run.epoch + 1, train_loss=record["loss"], merged=not adapter_only)
    extra = run.docs.files(eval=run.last_eval if "eval_loss" in record else None, **facts)
    write = WriteOptions(cfg.checkpoint.max_shard_size, dtype=_merged_dtype(run), adapter_only=adapter_only)
    options = SaveOptions(write, extra_files=extra, tokenizer_dir=run.docs.tokenizer_dir)
    training = train_state(run.model, run.optimizer, run.scheduler, run.scaler, run.position, ranks)
    kind = "adapter" if adapter_only else "adapter + merged"
    if run.saver is not None and run.saver.available(step):  # blocks for the snapshot (and a save still in flight)
        stall = run.saver.submit(step, state, options, training)
        record.update(checkpoint=ckpt.name, checkpoint_stall_s=stall)
        say(f"saving {ckpt.name} ({kind}) in the background; training blocked {stall:.2f} s")
        run.result.checkpoint = ckpt
        return None
    save = partial(run.manager.save, run.model, step, state, options, training, ranks)
    result, before, save_peak = run.memory.around_save(save)
    del training, save
    removed = run.manager.prune() if ranks.is_coordinator else []
    record.update(checkpoint=ckpt.name, checkpoint_save_s=result.seconds, checkpoint_bytes=result.total_bytes)
    record.update(checkpoint_peak_rss_mb=save_peak, checkpoint_stall_s=result.seconds)
    say(
        f"saved {ckpt.name} ({kind}, {result.total_bytes:,} bytes, {result.seconds:.2f} s, "
        f"peak RSS during save {save_peak:.0f} MB)" + (f"; removed {', '.join(removed)}" if removed else "")
    )
    run.result.checkpoint, run.result.last_save = ckpt, result
    run.result.rss_before_last_save_mb, run.result.peak_rss_last_save_mb = before, save_peak
    return result


def log_step(run: Run, on_step: Callable[[dict], None] | None = None) -> None:
    """The step's record, with memory figures (and a background save's, which may stop the run here with
    its failure), to metrics.jsonl, the trackers, the progress bar and ``on_step``."""
    record = run.record
    if run.saver is not None:
        run.saver.annotate(record, last=run.global_step >= run.stop_at)
    record.update(run.memory.snapshot())
    if run.metrics is not None:
        run.metrics.write(record)
    run.trackers.log(record)
    run.result.losses.append(record["loss"])
    run.bar.update(1)
    shown_eval = {"eval": f"{run.last_eval['eval_loss']:.4f}"} if run.last_eval else {}
    shown_eval.update({"ckpt": "saving"} if run.saver is not None and run.saver.in_flight else {})  # a background save runs
    run.bar.set_postfix(loss=f"{record['loss']:.4f}", **shown_eval, lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
    if on_step is not None:
        on_step(record)


def finish(run: Run) -> FinetuneResult:
    """Wait for the last background save, close the logs, draw the loss curve (loss.png) and print the summary."""
    if run.saver is not None:
        run.saver.close()
    run.bar.close()
    run.trackers.close()
    run.docs.close()
    run.model.eval()
    result, step, total, last_eval = run.result, run.global_step, run.total_steps, run.last_eval
    result.global_step = step
    result.plot_path = plot_losses(run.manager.metrics_path, run.manager.plot_path) if run.ranks.is_coordinator else None
    snapshot = run.memory.snapshot()
    result.peak_rss_mb, result.peak_gpu_mb = snapshot["peak_rss_mb"], snapshot.get("peak_gpu_mb")
    if result.losses:
        first_step = step - len(result.losses) + 1
        evaluated = f"; eval loss {last_eval['eval_loss']:.4f} (perplexity {last_eval['eval_ppl']:.2f})" if last_eval else ""
        say(f"trained steps {first_step}-{step} of {total}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}{evaluated}")
    if step < total:
        say(f"stopped at step {step} (training.stop_after_steps); continue with resume=true")
    say(f"metrics: {run.manager.metrics_path}" + (f"; loss curve: {result.plot_path}" if result.plot_path else ""))
    if result.checkpoint is not None:
        say(f"newest checkpoint: {result.checkpoint}")
    if run.cfg.checkpoint.gguf and result.checkpoint is not None and step == total and run.ranks.is_coordinator:
        g = export_checkpoint_gguf(result.checkpoint, run.cfg.checkpoint.gguf, Path(run.cfg.model.path), run.cfg.checkpoint.gguf_verify)
        say(f"wrote {g.path} ({g.type}, {g.tensors} tensors, {g.bytes:,} bytes, {g.seconds:.1f} s) and {g.modelfile}")
    gpu = f"; peak GPU memory {result.peak_gpu_mb:.0f} MB" if result.peak_gpu_mb is not None else ""
    say(f"peak RSS of the run: {result.peak_rss_mb:.0f} MB{gpu}")
    return result


# ---------------------------------------------------------------------------------------------------
# Step helpers


def _adapter_only(run: Run) -> bool:
    """Whether this step's checkpoint holds the adapter only (checkpoint.merged)."""
    merged = run.cfg.checkpoint.merged
    return merged == "never" or (merged == "final" and run.global_step < run.total_steps)


def _merged_dtype(run: Run) -> torch.dtype | None:
    """checkpoint.merged_dtype, else the base's; None: each tensor in its own dtype (the base's for NF4
    weights, what the save writes when the compute dtype is the base's)."""
    if run.cfg.checkpoint.merged_dtype:
        return DTYPES[run.cfg.checkpoint.merged_dtype]
    return None if run.dtype == run.base_dtype else run.base_dtype


def _every(step: int, n: int | None) -> bool:
    return n is not None and step % n == 0


def _saves_before_the_end(run: Run) -> bool:
    """Whether this invocation reaches a save point before its last step (an epoch end, a multiple of
    checkpoint.save_every_n_steps): only then is there training for a background save to overlap. A run
    whose one save is its last saves synchronously and starts no writer beside its steps."""
    every = run.cfg.checkpoint.save_every_n_steps
    return any(_every(s, run.steps_per_epoch) or _every(s, every) for s in range(run.global_step + 1, run.stop_at))


def _read_data(cfg: Config, ranks: Ranks, resume: ResumePoint | None) -> tuple[object, object, Data, list[dict] | None]:
    """The tokenizer and the tokenized data, checked against the checkpoint resumed from; the embedded
    tiny model written (coordinator) once the data is known good. Returns (tokenizer, HF config, data,
    the built-in rows to write or None)."""
    dataset_path = Path(cfg.dataset.path)
    builtin_rows = None
    if not dataset_path.is_file():
        if not cfg.dataset.create_builtin:
            raise SlimtuneError(f"{dataset_path}: no such dataset file (dataset.path)")
        builtin_rows = builtin_tiny_records()  # written once the model has loaded: nothing is written before the checks
    model_dir = Path(cfg.model.path)
    create_tiny = not model_dir.exists() and cfg.model.create_tiny
    if create_tiny:  # the embedded model's tokenizer and config; the files are written once the data is known good
        tokenizer, hf_config = byte_tokenizer(), tiny_config()
    else:
        hf_config = load_hf_config(model_dir)  # a missing or malformed model directory fails here, before the tokenizer
        tokenizer = load_tokenizer(model_dir)
    rows = {str(dataset_path): builtin_rows} if builtin_rows is not None else None
    data = load_data(DataSpec.from_config(cfg), tokenizer, rows=rows, vocab_size=getattr(hf_config, "vocab_size", None))
    saved = resume.state if resume is not None else None
    if saved is not None and saved["dataset_sha256"] != data.sha256:
        raise SlimtuneError(f"cannot resume from {resume.path}: the content of the data files changed since the checkpoint was taken")
    if create_tiny:
        error = None
        if ranks.is_coordinator:
            try:
                make_tiny_checkpoint(model_dir, seed=cfg.seed)
            except BaseException as e:  # noqa: BLE001 - every rank raises below
                error = e
        ranks.agree(error, "writing the embedded tiny model")
        tokenizer = load_tokenizer(model_dir)
        say(f"embedded tiny Llama base written to {model_dir}")
    if data.dropped:
        say(f"data: {data.dropped} example(s) have no trained token within max_seq_len={cfg.dataset.max_seq_len}; skipped")
    if saved is not None and saved["num_examples"] != len(data.train):
        raise SlimtuneError(
            f"cannot resume from {resume.path}: the data tokenizes to {len(data.train)} examples now, {saved['num_examples']} then"
        )
    return tokenizer, hf_config, data, builtin_rows


def _load_model(cfg: Config, ranks: Ranks, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """NF4 base + fp32 adapters, frozen weights in the compute dtype, on the device. Under a process group
    the model comes out FSDP2-sharded, NF4 base and adapters alike (model.py says how)."""
    lora = _lora_config(cfg)
    progress = cfg.logging.progress_bar and ranks.is_coordinator
    model = load_qlora_model(Path(cfg.model.path), lora, seed=cfg.seed, progress=progress, ranks=ranks, dtype=dtype)
    say(f"lora targets ({', '.join(lora.target_modules)}): {', '.join(facts_of(model).targets)}")
    say(nf4_summary_line(nf4_report(model)))
    if not ranks.distributed:
        model.to(device)  # FSDP2 placed each rank's shards on its device already
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.training.compile:
        say(f"compile: {compile_decoder_layers(model)} decoder layers (torch.compile, regional); the first step compiles them")
    return model


def _lora_config(cfg: Config) -> LoRAConfig:
    return LoRAConfig(cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.use_rslora, list(cfg.lora.target_modules))


def _load_train_state(run: Run) -> None:
    """The checkpoint's training state into the run: adapters and optimizer state in place (resharded by
    DCP to this number of ranks), scheduler and loss scaler through their ``load_state_dict``, the data
    position, and this rank's RNG streams last. The learning rate and weight decay may change on resume:
    they come from the config (the scheduler's base rates replaced before its state is loaded)."""
    cfg, ranks, optimizer, scheduler = run.cfg, run.ranks, run.optimizer, run.scheduler
    template = train_state(run.model, optimizer, scheduler, run.scaler, (0, 0), ranks)
    restored = load_train_state(run.resume.path, template)  # the adapters and optimizer state in place, resharded
    set_optimizer_state_dict(run.model, optimizer, restored["optimizer"])
    scheduler.load_state_dict({**restored["scheduler"], "base_lrs": [cfg.optimizer.lr] * len(optimizer.param_groups)})
    for group in optimizer.param_groups:  # the rate of the next step, from the config's lr (the scheduler's next step agrees)
        group["weight_decay"] = cfg.optimizer.weight_decay
        group["lr"] = cfg.optimizer.lr * run.lr_factor(scheduler.last_epoch)
    if run.scaler.is_enabled() and restored.get("grad_scaler"):
        run.scaler.load_state_dict(restored["grad_scaler"])
    saved = run.resume.state
    run.global_step = saved["global_step"]
    run.epoch, run.step_in_epoch = restored["position"]["epoch"], restored["position"]["step_in_epoch"]
    world_then = saved.get("world_size", 1)
    if world_then != ranks.world_size:
        say(f"resume: the checkpoint was written by {world_then} rank(s), this run has {ranks.world_size}: state resharded by DCP")
    rng = restored.get("rng", {}).get(str(ranks.rank))
    if rng is not None:
        set_rng_state(rng)  # last: nothing may draw random numbers between here and the next step
    else:  # a rank the checkpoint did not have: a fresh stream of its own
        seed_everything(cfg.seed + ranks.rank + 1_000_003 * run.global_step)
    name = run.resume.path.name
    say(f"resumed from {name}: step {run.global_step}, epoch {run.epoch + 1}, step {run.step_in_epoch + 1} of the epoch next")


# ---------------------------------------------------------------------------------------------------
# Set-up helpers


def say(message: str) -> None:
    """A log line on stdout that does not tear the progress bar; under torchrun only rank 0 speaks."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing per decoder layer: works with frozen inputs and restores the RNG for
    the recomputation, so dropout masks (and exact resume) are unchanged. transformers 5 renamed the call."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor for optimizer step ``step`` (0-based): linear warmup to 1, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CUDA generators too


# ---------------------------------------------------------------------------------------------------
# Training-loop helpers


def rank_batch(examples: list, batch: list[int], ranks: Ranks, pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of a global micro-batch (``split_rows``), collated. A rank whose
    slice is empty (a short last batch) still runs the forward and backward passes FSDP2's collectives
    need, on one example with no trained token: it adds nothing to the loss or the gradients."""
    start, end = split_rows(len(batch), ranks.world_size)[ranks.rank]
    if end > start:
        return collate([examples[i] for i in batch[start:end]], pad_id)
    filler = collate([examples[batch[0]]], pad_id)
    filler["labels"].fill_(IGNORE_INDEX)
    return filler


def all_sum(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``value`` summed over the ranks (itself in one process)."""
    if ranks.distributed and ranks.world_size > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def _evaluate(model: nn.Module, examples: list, batch_size: int, pad_id: int, device: torch.device, ranks: Ranks) -> dict:
    """Token-mean loss and perplexity over ``examples``: dropout off, no gradient, and the RNG state
    forked around it, so training continues exactly as without evaluation. Each rank evaluates its
    slice of every batch (``rank_batch``: every rank runs each forward FSDP2 needs); sums are all-reduced."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = {
                k: v.to(device)
                for k, v in rank_batch(examples, list(range(start, min(start + batch_size, len(examples)))), ranks, pad_id).items()
            }
            total += token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"]).double()
            count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model.train(was_training)
    reshard(model)
    total = all_sum(total, ranks).item()
    count = int(all_sum(torch.tensor(float(count), dtype=torch.float64, device=device), ranks).item())
    loss = total / max(1, count)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def _sample_generations(run: Run) -> list:
    """training.sample_prompts, generated greedily in the prompt format training used (RNG untouched)."""
    model, cfg = run.model, run.cfg
    was_training = model.training
    model.eval()
    loaded = Loaded(model, run.tokenizer, "adapter", prompt_format_of(run.data.shapes), run.device)
    options = SamplingOptions(max_new_tokens=cfg.training.sample_max_new_tokens, temperature=0.0)
    samples = [{"prompt": p, "text": generate(loaded, prompt_ids(loaded, prompt=p), options)} for p in cfg.training.sample_prompts]
    reshard(model)
    model.train(was_training)
    return samples


class CheckpointDocs:
    """What each checkpoint carries beside the weights: the tokenizer files with the chat template
    training rendered conversations with (the fallback one when the base tokenizer had none), the
    model card (README.md, at the root and in adapter/) and slimtune_format.json (the prompt format).
    Staged in a temporary directory and copied in by the save, under its manifest."""

    def __init__(self, tokenizer, cfg: Config, data, hf_config, merged_dtype: torch.dtype, nf4: dict):
        self._tmp = tempfile.TemporaryDirectory(prefix="slimtune-docs-")
        self.root = Path(self._tmp.name)
        self.tokenizer_dir = self.root / "tokenizer"
        base_files = tokenizer_files(Path(cfg.model.path))
        if getattr(tokenizer, "chat_template", None) and base_files:  # the base's files as they are, as an offline merge
            self.tokenizer_dir.mkdir()  # copies them (a save_pretrained would add its load arguments to tokenizer_config.json)
            for src in base_files:
                shutil.copyfile(src, self.tokenizer_dir / src.name)
        else:  # the saved copy gets the template training rendered chat rows with
            tokenizer.save_pretrained(str(self.tokenizer_dir))
            load_tokenizer(self.tokenizer_dir, chat_template=FALLBACK_CHAT_TEMPLATE).save_pretrained(str(self.tokenizer_dir))
            generation = Path(cfg.model.path) / "generation_config.json"  # the base's, as an offline merge copies it
            if generation.is_file():
                shutil.copyfile(generation, self.tokenizer_dir / generation.name)
        self.record = {**format_record(data.shapes, getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE), "nf4": nf4}
        self.common = dict(
            base=cfg.model.path,
            model_type=str(getattr(hf_config, "model_type", "unknown")),
            lora=dict(
                rank=cfg.lora.rank,
                alpha=cfg.lora.alpha,
                dropout=cfg.lora.dropout,
                use_rslora=cfg.lora.use_rslora,
                target_modules=list(cfg.lora.target_modules),
            ),
            files=data.files,
            shapes=dict(data.shapes),
            prompt_format=self.record["prompt_format"],
            merged_dtype=str(merged_dtype).removeprefix("torch."),
            nf4=nf4,
        )

    def files(self, **facts) -> dict[str, Path]:
        card = self.root / "README.md"
        card.write_text(model_card(CardFacts(**self.common, **facts)))
        fmt = self.root / FORMAT_NAME
        fmt.write_text(json.dumps(self.record, indent=2) + "\n")
        extra = {"README.md": card, f"{ADAPTER_DIR}/README.md": card, FORMAT_NAME: fmt}
        extra.update({f"{ADAPTER_DIR}/{p.name}": p for p in tokenizer_files(self.tokenizer_dir)})
        return extra

    def close(self) -> None:
        self._tmp.cleanup()


class PeakMemory:
    """Peak RSS of the whole run, and of each save on its own (VmHWM is reset around a save, so the run's
    peak is carried across the reset). Peak GPU memory where there is a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.run_peak = peak_rss_mb()

    def around_save(self, save: Callable[[], SaveResult]) -> tuple[SaveResult, float, float]:
        self.run_peak = max(self.run_peak, peak_rss_mb())
        before = rss_mb()
        reset_peak_rss()
        result = save()
        save_peak = peak_rss_mb()
        self.run_peak = max(self.run_peak, save_peak)
        return result, before, save_peak

    def snapshot(self) -> dict:
        figures = {"peak_rss_mb": max(self.run_peak, peak_rss_mb())}
        if self.device.type == "cuda":
            figures["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return figures


# ---------------------------------------------------------------------------------------------------
# Checkpointing helpers


def recipe_state(cfg: Config, global_step: int, dataset_sha: str, num_examples: int, total_steps: int, ranks: Ranks) -> dict:
    """The run's facts resume checks before anything is loaded: plain containers only, so it loads with
    ``torch.load(weights_only=True)``. The training state itself is ``train_state``'s."""
    return {
        "format": STATE_FORMAT,
        "global_step": global_step,
        "total_steps": total_steps,
        "world_size": ranks.world_size,
        "config": dict(cfg.values),
        "dataset_sha256": dataset_sha,
        "num_examples": num_examples,
    }


def train_state(model: nn.Module, optimizer, scheduler, scaler, position: tuple[int, int], ranks: Ranks) -> dict:
    """What the next step depends on beyond the run's facts, laid out for torch.distributed.checkpoint:
    the adapters and the optimizer state by parameter name (DTensor shards under FSDP2, whole tensors in
    one process: DCP reshards between the two), scheduler, loss scaler, the data position (epoch, 0-based,
    and step within it) and this rank's RNG states under its rank. Built fresh for a save; for a resume
    it is the template DCP fills in place."""
    adapters = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    return {
        "adapter": adapters,
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "grad_scaler": scaler.state_dict(),
        "position": {"epoch": position[0], "step_in_epoch": position[1]},
        "rng": {str(ranks.rank): rng_state()},
    }


def plot_losses(metrics_path: Path, png_path: Path) -> Path | None:
    """The loss curve of the whole run from metrics.jsonl as a PNG: train loss per step, eval loss where
    evaluated, the learning rate, checkpoints (dotted) and resumes (dashed), integer step ticks."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", linewidth=1.2, label="train loss")
    evaluated = [r for r in rows if "eval_loss" in r]
    if evaluated:
        eval_steps, eval_losses = [r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated]
        ax.plot(eval_steps, eval_losses, "o-", color="tab:green", markersize=3, label="eval loss")
    for r in rows:
        if "checkpoint" in r:
            ax.axvline(r["step"], color="0.8", linewidth=0.8, linestyle=":")
        if "resumed_from" in r:
            ax.axvline(r["resumed_from"] + 0.5, color="tab:red", linewidth=1.0, linestyle="--", label="resumed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.legend(loc="upper right", fontsize=8)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in rows], color="tab:orange", linewidth=1.0, alpha=0.7)
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    ax.set_title(f"{metrics_path.parent.name}: loss per step (dotted: checkpoints, dashed: resumed)")
    fig.tight_layout()
    with os_errors("write the loss curve", png_path):
        write_atomic(png_path, fig.savefig, suffix=".partial.png")  # the suffix tells matplotlib the format
    return png_path
