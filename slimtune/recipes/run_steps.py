"""The run's steps every objective shares, around the objective's own batching, loss and evaluation: where the run
computes (``place``), its run directory and resume point (``open_run_dir``), the embedded tiny base
(``write_tiny_base``), the tokenizer and data (``read_data``: SFT rows or preference pairs), the step
arithmetic (``plan_span``), the QLoRA model (``load_model``), AdamW and its
schedule (``make_optimization``), then ``restore`` (a fresh output_dir or the checkpoint's state),
``save_step`` (a checkpoint), ``log_step`` (a step's record to every sink) and ``finish``. ``prepare``
runs the set-up steps in order and returns the ``Run``; ``finetune.setup`` calls it, then the objective's
own set-up. The loop (``recipes/finetune.py``) calls the rest.

What a run holds between its steps is ``Run`` (``recipes/run.py``).

Example (``finetune.setup``)::

    run = prepare(cfg, ranks, dropped=objective.dropped)  # the shared steps, in order
    objective.setup(run)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slimtune.checkpoint.background import BackgroundSaver, WriterSpec
from slimtune.checkpoint.extras import CheckpointDocs
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.run_state import (
    Optimization,
    ResumePoint,
    check_data,
    check_resumable,
    recipe_state,
    restore_training,
    training_state,
)
from slimtune.checkpoint.save import SaveOptions, SaveResult
from slimtune.checkpoint.train_state import seed_everything
from slimtune.checkpoint.writer import WriteOptions
from slimtune.config import Config
from slimtune.data import DataSpec, builtin_tiny_records, epoch_steps, load_data, write_jsonl
from slimtune.distributed import Ranks, reshard
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.fileio import os_errors
from slimtune.formats.format_record import prompt_format_of
from slimtune.formats.hf import read_model_config
from slimtune.formats.hub import ModelSource, is_dataset_id, is_hub_id, resolve_model
from slimtune.formats.peft import read_adapter
from slimtune.formats.serving import serving_problems, serving_report
from slimtune.generate import Loaded, SamplingOptions, generate, prompt_ids
from slimtune.gguf.export import export_checkpoint_gguf
from slimtune.lora import LoRAConfig, lora_modules, lora_parameters
from slimtune.memory import PeakMemory
from slimtune.model import load_processor, load_qlora_model, load_tokenizer, nf4_report, nf4_summary_line, pick_device, pick_dtype
from slimtune.recipes.run import DevicePlacement, FinetuneResult, Inputs, Run, Span
from slimtune.runtime import choose_num_threads, compile_decoder_layers, enable_activation_checkpointing
from slimtune.schedule import warmup_cosine
from slimtune.tensors import DTYPES
from slimtune.tiny import byte_tokenizer, make_tiny_checkpoint, tiny_llama_config
from slimtune.tracking import MetricsLog, Trackers, plot_losses
from slimtune.vision_families import vision_parts

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Set-up steps


def place(cfg: Config, ranks: Ranks) -> DevicePlacement:
    """The device (this rank's GPU under torchrun), the compute dtype and the CPU threads.

    Example: ``where = place(cfg, SINGLE)``"""
    device = pick_device(cfg.device)
    if device.type == "cuda" and ranks.distributed:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed bound this rank to its GPU
    dtype = pick_dtype(cfg.dtype, device)
    if ranks.distributed and dtype == torch.float16:
        raise SlimtuneError("dtype fp16 (loss scaling) is for one process; with several ranks use bf16 or fp32")
    return DevicePlacement(ranks, device, dtype, choose_num_threads(cfg.training.num_threads))


def open_run_dir(cfg: Config) -> tuple[CheckpointManager, ResumePoint | None]:
    """output_dir's manager and the checkpoint to resume from (None: a fresh start), the config checked
    against it; a run directory that holds another run's checkpoints is refused. Writes nothing.

    Example: ``manager, resume = open_run_dir(cfg)``"""
    manager = CheckpointManager(Path(cfg.output_dir), cfg.checkpoint.keep_last_n)
    resume = manager.find_resume_point(cfg.resume, cfg.overwrite)  # or refuse to mix two runs
    if resume is not None:
        check_resumable(cfg, resume)
    return manager, resume


def needs_tiny_base(cfg: Config) -> bool:
    """Whether the run makes the embedded tiny base (model.create_tiny, no model.path yet, and model.path
    not a hub id: nothing is ever written at a path that would be looked up on the hub)."""
    return cfg.model.create_tiny and not is_hub_id(cfg.model.path) and not Path(cfg.model.path).exists()


def resolve_base(cfg: Config, ranks: Ranks, resume: ResumePoint | None) -> ModelSource:
    """model.path as a directory: the tiny model's (written later), a local directory, or a hub id resolved
    (and fetched) by the coordinator first, then by the other ranks from the cache. A resumed run must find
    the commit it was trained on: a hub repo that moved on since is refused in one line.

    Example: ``base = resolve_base(cfg, SINGLE, None)``"""
    if needs_tiny_base(cfg):
        return ModelSource(Path(cfg.model.path))
    error, base = None, None
    if ranks.is_coordinator:
        try:
            base = resolve_model(cfg.model.path)
        except BaseException as e:  # noqa: BLE001 - every rank raises below
            error = e
    ranks.agree(error, "resolving model.path")
    base = base or resolve_model(cfg.model.path)
    then = (resume.state.get("base") or {}).get("revision") if resume is not None else None
    if then is not None and then != base.revision:
        raise SlimtuneError(
            f"cannot resume from {resume.path}: model.path {cfg.model.path} is at commit {base.revision} now, the checkpoint was "
            f"trained on {then} (the repo moved on); set model.path={base.hub_id}@{then} to resume"
        )
    return base


def warn_unservable(cfg: Config) -> None:
    """One warning line once the model is loaded (before training) when lora.* make an adapter vLLM or SGLang will not load, or
    loads differently (formats/serving.py; it is trained and saved all the same: PEFT and slimtune load it)."""
    lora = lora_config(cfg)
    config = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": lora.target_modules, "use_rslora": lora.use_rslora}
    if serving := serving_problems(config):
        log.warning(f"warning: serving this run's adapter: {'; '.join(serving)} (docs/checkpoints.md: serving)")


def write_tiny_base(cfg: Config, ranks: Ranks) -> object:
    """The embedded tiny Llama base written to model.path (by the coordinator, once the data is known
    good); returns its tokenizer as loaded from there.

    Example: ``inputs.tokenizer = write_tiny_base(cfg, ranks)``"""
    model_dir = Path(cfg.model.path)
    error = None
    if ranks.is_coordinator:
        try:
            make_tiny_checkpoint(model_dir, seed=cfg.seed)
        except BaseException as e:  # noqa: BLE001 - every rank raises below
            error = e
    ranks.agree(error, "writing the embedded tiny model")
    log.info(f"embedded tiny Llama base written to {model_dir}")
    return load_tokenizer(model_dir)


def read_data(cfg: Config, resume: ResumePoint | None, base: ModelSource) -> Inputs:
    """The tokenizer and the tokenized data (SFT rows, or preference pairs for a preference objective:
    ``DataSpec.from_config``), checked against the checkpoint resumed from (``check_data``).
    Writes nothing: the built-in rows (when dataset.path does not exist) are written by ``restore``, the
    embedded tiny model by ``write_tiny_base``, whose tokenizer and config stand in until then.

    Example: ``inputs = read_data(cfg, None, resolve_base(cfg, SINGLE, None))``"""
    dataset_path = Path(cfg.dataset.path)
    builtin_rows = None
    if not dataset_path.is_file() and not is_dataset_id(cfg.dataset.path):  # a hub dataset is read by load_data
        if not cfg.dataset.create_builtin:
            raise SlimtuneError(f"{dataset_path}: no such dataset file (dataset.path)")
        builtin_rows = builtin_tiny_records()
    processor = None
    if needs_tiny_base(cfg):  # the embedded model's tokenizer and config, before its files exist
        tokenizer, hf_config = byte_tokenizer(), tiny_llama_config()
    else:
        hf_config = read_model_config(base.path)  # a malformed model directory fails here, before the tokenizer
        tokenizer = load_tokenizer(base.path)
        if vision_parts(getattr(hf_config, "model_type", "")) and cfg.training.objective == "sft":  # image rows: SFT only
            processor = load_processor(base.path)
            if not getattr(tokenizer, "chat_template", None):  # the processor's (chat_template.json): the one chat rows render with
                tokenizer.chat_template = getattr(processor, "chat_template", None)
    rows = {str(dataset_path): builtin_rows} if builtin_rows is not None else None
    vocab_size = getattr(hf_config.get_text_config(), "vocab_size", None)  # a vision model's: its language model's
    data = load_data(DataSpec.from_config(cfg), tokenizer, rows=rows, vocab_size=vocab_size, processor=processor)
    if resume is not None:
        check_data(resume, data)
    return Inputs(tokenizer=tokenizer, hf_config=hf_config, data=data, base=base, builtin_rows=builtin_rows)


def plan_span(cfg: Config, num_examples: int) -> Span:
    """Steps per epoch (training.batch_size x gradient_accumulation_steps examples each), the run's
    steps (training.total_epochs, capped by training.max_steps) and where this invocation stops.

    Example: ``plan_span(cfg, 100).total_steps``"""
    steps_per_epoch = len(epoch_steps(list(range(num_examples)), cfg.training.batch_size, cfg.training.gradient_accumulation_steps))
    total_steps = cfg.training.total_epochs * steps_per_epoch
    if cfg.training.max_steps is not None:
        total_steps = min(total_steps, cfg.training.max_steps)
    stop_at = total_steps if cfg.training.stop_after_steps is None else min(total_steps, cfg.training.stop_after_steps)
    return Span(steps_per_epoch, total_steps, stop_at)


def lora_config(cfg: Config) -> LoRAConfig:
    """The config's lora section as the model loader takes it."""
    lora = cfg.lora
    return LoRAConfig(lora.rank, lora.alpha, lora.dropout, lora.use_rslora, list(lora.target_modules), vision=lora.vision)


def load_model(cfg: Config, where: DevicePlacement, base: ModelSource) -> nn.Module:
    """NF4 base + fp32 adapters, frozen weights in the compute dtype, on the device. Under a process group
    the model comes out FSDP2-sharded, NF4 base and adapters alike (model.py says how).

    Example: ``model = load_model(cfg, where)``"""
    lora, ranks = lora_config(cfg), where.ranks
    progress = cfg.logging.progress_bar and ranks.is_coordinator
    model = load_qlora_model(base, lora, seed=cfg.seed, progress=progress, ranks=ranks, dtype=where.dtype)
    log.info(f"lora targets ({', '.join(lora.target_modules)}): {', '.join(facts_of(model).targets)}")
    report = nf4_report(model)
    log.info(nf4_summary_line(report))
    if report.get("bnb4"):
        log.info("merge base of the merged saves: the base file's dequantized 4-bit weights (bitsandbytes' own dequantization)")
    if not ranks.distributed:
        model.to(where.device)  # FSDP2 placed each rank's shards on its device already
    if cfg.model.adapter:
        log.info(f"adapters start from {load_start_adapter(model, Path(cfg.model.adapter), lora)}")
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.training.compile:
        log.info(f"compile: {compile_decoder_layers(model)} decoder layers (torch.compile, regional); the first step compiles them")
    return model


def load_start_adapter(model: nn.Module, path: Path, lora: LoRAConfig) -> Path:
    """model.adapter's weights (a checkpoint, its adapter/ directory or its adapter_model.safetensors; read
    and checked by ``read_adapter``) into the model's adapters, bit for bit (each rank its shard under
    FSDP2); its rank, alpha, rsLoRA and modules must be the config's. Returns the adapter directory.

    Example: ``load_start_adapter(model, Path("runs/sft/step-000100"), lora_config(cfg))``"""
    adapter = read_adapter(path.parent if path.is_file() else path)
    mine = lora_modules(model)
    for name, m in adapter.modules.items():
        if name not in mine:
            targets = ", ".join(lora.target_modules)
            raise SlimtuneError(f"{adapter.path}: module {name} has no adapter in this model (lora.target_modules: {targets})")
        if (m.rank, m.alpha, adapter.use_rslora) != (lora.rank, lora.alpha, lora.use_rslora) or m.embedding or m.magnitude is not None:
            raise SlimtuneError(
                f"{adapter.path}: module {name} has r={m.rank}, lora_alpha={m.alpha}, use_rslora={adapter.use_rslora}; "
                f"the config has lora.rank={lora.rank}, lora.alpha={lora.alpha}, lora.use_rslora={lora.use_rslora} (plain LoRA only)"
            )
    missing = sorted(set(mine) - set(adapter.modules))
    if missing:
        more = " ..." if len(missing) > 3 else ""
        raise SlimtuneError(f"{adapter.path}: no adapter for {', '.join(missing[:3])}{more} (lora.target_modules)")
    with torch.no_grad():
        for name, module in mine.items():
            for param, full in ((module.lora_a.weight, adapter.modules[name].lora_a), (module.lora_b.weight, adapter.modules[name].lora_b)):
                if tuple(full.shape) != tuple(param.shape):
                    raise SlimtuneError(f"{adapter.path}: module {name}: shape {list(full.shape)}, the model's is {list(param.shape)}")
                param.copy_(_placed_like(full.to(param.dtype), param))
    return adapter.path


def _placed_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param``: this rank's shard of it for a DTensor (FSDP2), else itself on its device."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return full.to(param.device)
    from torch.distributed.tensor import DTensor, distribute_tensor  # FSDP2 may have sharded: not loaded by a one-process run

    if isinstance(param, DTensor):
        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
    return full.to(param.device)


def prepare(cfg: Config, ranks: Ranks, dropped: str) -> Run:
    """The set-up every recipe shares, in order: ``place``, ``open_run_dir``, ``read_data`` (the tokenizer and
    the recipe's data: ``DataSpec.from_config``), the embedded tiny base when asked for, one line for the
    rows the data reader left out (``dropped``: what they were, after the count), ``plan_span``,
    ``load_model``, ``warn_unservable`` and ``make_optimization``; a recipe's ``setup`` adds its own parts
    to the ``Run`` this returns. Writes nothing but the embedded tiny model, once the data is known good.

    Example: ``run = prepare(cfg, SINGLE, dropped="example(s) skipped")``"""
    where = place(cfg, ranks)
    manager, resume = open_run_dir(cfg)
    inputs = read_data(cfg, resume, resolve_base(cfg, ranks, resume))
    if needs_tiny_base(cfg):
        inputs.tokenizer = write_tiny_base(cfg, ranks)
    if inputs.data.dropped:
        log.info(f"data: {inputs.data.dropped} {dropped}")
    span = plan_span(cfg, len(inputs.data.train))
    model = load_model(cfg, where, inputs.base)
    warn_unservable(cfg)  # after the load's own checks of lora.rank: a refused rank is one line, no warning beside it
    optim = make_optimization(model, cfg, span.total_steps, where)
    return Run(cfg=cfg, where=where, manager=manager, resume=resume, inputs=inputs, model=model, optim=optim, span=span)


def make_optimization(model: nn.Module, cfg: Config, total_steps: int, where: DevicePlacement) -> Optimization:
    """AdamW on the adapters, linear warmup then cosine decay over ``total_steps``, and the loss scaler
    (enabled for fp16 only).

    Example: ``optim = make_optimization(model, cfg, span.total_steps, where)``"""
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    lr_factor = partial(warmup_cosine, warmup=cfg.scheduler.warmup_steps, total=total_steps, min_ratio=cfg.scheduler.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler(where.device.type, enabled=where.dtype == torch.float16)
    return Optimization(optimizer, scheduler, scaler, lr_factor)


# ---------------------------------------------------------------------------------------------------
# The steps


def restore(run: Run) -> None:
    """Where writing starts: a fresh output_dir (leftovers removed, the previous run's files with
    overwrite, the built-in dataset written), or everything restored from the checkpoint resumed from
    (adapters, optimizer, scheduler, loss scaler, data position, RNG: ``restore_training``). Then the
    run's logs open: metrics.jsonl (cut back to the checkpoint's step), trackers, progress bar.

    Example: ``restore(run)``"""
    cfg, ranks = run.cfg, run.where.ranks
    error = None
    if ranks.is_coordinator:
        try:
            run.manager.prepare(fresh_start=run.resume is None, overwrite=cfg.overwrite)
            if run.inputs.builtin_rows is not None:
                with os_errors("write the built-in dataset to", Path(cfg.dataset.path)):
                    write_jsonl(Path(cfg.dataset.path), run.inputs.builtin_rows)
                log.info(f"built-in dataset written to {cfg.dataset.path}")
        except BaseException as e:  # noqa: BLE001 - every rank raises below
            error = e
    ranks.agree(error, "preparing output_dir")
    at = run.at
    if run.resume is None:
        seed_everything(cfg.seed + ranks.rank)
    else:
        at.global_step, (at.epoch, at.step_in_epoch) = restore_training(run.resume, run.model, run.optim, cfg, ranks)
        name, next_step = run.resume.path.name, at.step_in_epoch + 1
        log.info(f"resumed from {name}: step {at.global_step}, epoch {at.epoch + 1}, step {next_step} of the epoch next")
    at.position, at.first_step = (at.epoch, at.step_in_epoch), at.global_step + 1
    inputs = run.inputs
    merged = merged_dtype(run) or run.base_dtype
    run.docs = CheckpointDocs(inputs.tokenizer, cfg, inputs.base, inputs.data, inputs.hf_config, merged, nf4_report(run.model))
    if ranks.is_coordinator:
        last_record = run.resume.state.get("metrics") if run.resume is not None else None
        run.sinks.metrics = MetricsLog(run.manager.metrics_path, keep_through_step=at.global_step, last_record=last_record)
        run.sinks.trackers = Trackers.from_config(cfg, run.manager.out, resume_step=at.global_step)
    if cfg.checkpoint.async_ and _saves_before_the_end(run):  # on a GPU / under torchrun its writers load now
        spec = WriterSpec(inputs.base, lora_config(cfg), cfg.seed, run.where.dtype)
        run.saver = BackgroundSaver(spec, run.manager, ranks=ranks, model=run.model)
    run.sinks.memory = PeakMemory(run.where.device)
    run.result = FinetuneResult(run.model, inputs.tokenizer, run.manager.out, at.global_step, metrics_path=run.manager.metrics_path)
    if at.global_step >= run.span.stop_at:
        log.info(f"nothing to train: the run is at step {at.global_step} and stops at step {run.span.stop_at}")
    run.model.train()
    progress = cfg.logging.progress_bar and ranks.is_coordinator
    bar = dict(desc="train", unit="step", dynamic_ncols=True, disable=not progress)
    run.sinks.bar = tqdm(total=run.span.total_steps, initial=at.global_step, **bar)


def save_step(run: Run) -> SaveResult | None:
    """Samples (training.sample_prompts) into the step's record, then ``step-N`` through the manager,
    written by every rank: the merged model (unless checkpoint.merged says adapter only), the adapter,
    tokenizer, model card, recipe state and training state; then pruning (keep_last_n). With
    checkpoint.async the background writers write it (one per rank, the same cooperative save): this
    step blocks only for the snapshot (``checkpoint_stall_s``) and returns None; ``log_step`` reports the
    save when every rank's writer has finished it. The run's last save point waits for the save in
    flight (``checkpoint_final_wait_s``) and writes its own save here, synchronously: no training is left
    for a background save to overlap, and the trainer's threads write it faster than a forked writer's one.

    Example: ``if save_now: save_step(run)``"""
    cfg, ranks, record, step = run.cfg, run.where.ranks, run.record, run.at.global_step
    if cfg.training.sample_prompts:
        record["samples"] = _sample_generations(run)
        for sample in record["samples"]:
            log.info(f"sample at step {step}: {sample['prompt']!r} -> {sample['text']!r}")  # every rank ran it: FSDP2 needs all
    ckpt = run.manager.step_path(step)
    data = run.inputs.data
    state = {**recipe_state(cfg, step, data.sha256, len(data.train), run.span.total_steps, ranks), "base": run.inputs.base.record()}
    state.update(run.extra_state)
    state["metrics"] = {**record, "checkpoint": ckpt.name}  # rewritten on resume if a kill takes it
    only_adapter = adapter_only(run)
    facts = dict(step=step, total_steps=run.span.total_steps, epoch=run.at.epoch + 1, train_loss=record["loss"], merged=not only_adapter)
    extra = run.docs.files(eval=run.last_eval if "eval_loss" in record else None, **facts)
    write = WriteOptions(cfg.checkpoint.max_shard_size, dtype=merged_dtype(run), adapter_only=only_adapter)
    options = SaveOptions(write, extra_files=extra, tokenizer_dir=run.docs.tokenizer_dir)
    training = training_state(run.model, run.optim, run.at.position, ranks)
    kind = "adapter" if only_adapter else "adapter + merged"
    if run.saver is not None and step >= run.span.stop_at:  # the run's last save: nothing left to overlap
        record["checkpoint_final_wait_s"] = run.saver.wait()  # the save in flight first; this one synchronously
    elif run.saver is not None and run.saver.available(step):  # blocks for the snapshot (and a save still in flight)
        stall = run.saver.submit(step, state, options, training)
        record.update(checkpoint=ckpt.name, checkpoint_stall_s=stall)
        log.info(f"saving {ckpt.name} ({kind}) in the background; training blocked {stall:.2f} s")
        run.result.checkpoint = ckpt
        return None
    save = partial(run.manager.save, run.model, step, state, options, training, ranks)
    result, before, save_peak = run.sinks.memory.around_save(save)
    del training, save
    removed = run.manager.prune() if ranks.is_coordinator else []
    record.update(checkpoint=ckpt.name, checkpoint_save_s=result.seconds, checkpoint_bytes=result.total_bytes)
    record.update(checkpoint_peak_rss_mb=save_peak, checkpoint_stall_s=result.seconds)
    log.info(
        f"saved {ckpt.name} ({kind}, {result.total_bytes:,} bytes, {result.seconds:.2f} s, "
        f"peak RSS during save {save_peak:.0f} MB)" + (f"; removed {', '.join(removed)}" if removed else "")
    )
    run.result.checkpoint, run.result.last_save = ckpt, result
    run.result.rss_before_last_save_mb, run.result.peak_rss_last_save_mb = before, save_peak
    return result


def log_step(run: Run, on_step: Callable[[dict], None] | None = None, shown: dict | None = None) -> None:
    """The step's record, with memory figures (and a background save's, which may stop the run here with
    its failure), to metrics.jsonl, the trackers, the progress bar and ``on_step``. ``shown``: the
    progress bar's figures beside the loss (default: the last eval loss).

    Example: ``log_step(run, on_step=print)``"""
    record, sinks = run.record, run.sinks
    if run.saver is not None:
        run.saver.annotate(record, last=run.at.global_step >= run.span.stop_at)
    record.update(sinks.memory.snapshot())
    if sinks.metrics is not None:
        sinks.metrics.write(record)
    sinks.trackers.log(record)
    run.result.losses.append(record["loss"])
    sinks.bar.update(1)
    if shown is None:
        shown = {"eval": f"{run.last_eval['eval_loss']:.4f}"} if run.last_eval and "eval_loss" in run.last_eval else {}
    shown = {**shown, **({"ckpt": "saving"} if run.saver is not None and run.saver.in_flight else {})}  # a background save runs
    sinks.bar.set_postfix(loss=f"{record['loss']:.4f}", **shown, lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
    if on_step is not None:
        on_step(record)


def finish(run: Run) -> FinetuneResult:
    """Wait for the last background save, close the logs, draw the loss curve (loss.png) and log the summary.

    Example: ``return finish(run)``"""
    if run.saver is not None:
        run.saver.close()
    run.sinks.bar.close()
    run.sinks.trackers.close()
    run.docs.close()
    run.model.eval()
    result, step, total, last_eval = run.result, run.at.global_step, run.span.total_steps, run.last_eval
    result.global_step = step
    result.plot_path = plot_losses(run.manager.metrics_path, run.manager.plot_path) if run.where.ranks.is_coordinator else None
    snapshot = run.sinks.memory.snapshot()
    result.peak_rss_mb, result.peak_gpu_mb = snapshot["peak_rss_mb"], snapshot.get("peak_gpu_mb")
    if result.losses:
        first_step = step - len(result.losses) + 1
        evaluated = ""
        if last_eval and "eval_ppl" in last_eval:  # a recipe whose evaluation reports other figures says them itself
            evaluated = f"; eval loss {last_eval['eval_loss']:.4f} (perplexity {last_eval['eval_ppl']:.2f})"
        log.info(f"trained steps {first_step}-{step} of {total}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}{evaluated}")
    if step < total:
        log.info(f"stopped at step {step} (training.stop_after_steps); continue with resume=true")
    log.info(f"metrics: {run.manager.metrics_path}" + (f"; loss curve: {result.plot_path}" if result.plot_path else ""))
    if result.checkpoint is not None:
        log.info(f"newest checkpoint: {result.checkpoint}")
        commands, problems = serving_report(result.checkpoint, run.inputs.base.name) if run.where.ranks.is_coordinator else ([], [])
        for line in commands:
            log.info(f"serve the adapter: {line}")
        for line in problems:
            log.warning(f"warning: {line}")
    if run.cfg.checkpoint.gguf and result.checkpoint is not None and step == total and run.where.ranks.is_coordinator:
        g = export_checkpoint_gguf(result.checkpoint, run.cfg.checkpoint.gguf, run.inputs.base.path, run.cfg.checkpoint.gguf_verify)
        log.info(f"wrote {g.path} ({g.type}, {g.tensors} tensors, {g.bytes:,} bytes, {g.seconds:.1f} s) and {g.modelfile}")
        if g.mmproj is not None:
            log.info(f"wrote {g.mmproj.path} (the vision tower and projector, {g.mmproj.type}, {g.mmproj.bytes:,} bytes)")
    gpu = f"; peak GPU memory {result.peak_gpu_mb:.0f} MB" if result.peak_gpu_mb is not None else ""
    log.info(f"peak RSS of the run: {result.peak_rss_mb:.0f} MB{gpu}")
    return result


# ---------------------------------------------------------------------------------------------------
# Step helpers


def every(step: int, n: int | None) -> bool:
    """Whether ``step`` is a multiple of ``n`` (never when ``n`` is None)."""
    return n is not None and step % n == 0


def adapter_only(run: Run) -> bool:
    """Whether this step's checkpoint holds the adapter only (checkpoint.merged)."""
    merged = run.cfg.checkpoint.merged
    return merged == "never" or (merged == "final" and run.at.global_step < run.span.total_steps)


def merged_dtype(run: Run) -> torch.dtype | None:
    """checkpoint.merged_dtype, else the base's; None: each tensor in its own dtype (the base's for NF4
    weights, what the save writes when the compute dtype is the base's)."""
    if run.cfg.checkpoint.merged_dtype:
        return DTYPES[run.cfg.checkpoint.merged_dtype]
    return None if run.where.dtype == run.base_dtype else run.base_dtype


def _saves_before_the_end(run: Run) -> bool:
    """Whether this invocation reaches a save point before its last step (an epoch end, a multiple of
    checkpoint.save_every_n_steps): only then is there training for a background save to overlap. A run
    whose one save is its last saves synchronously and starts no writer beside its steps."""
    every_n = run.cfg.checkpoint.save_every_n_steps
    return any(every(s, run.span.steps_per_epoch) or every(s, every_n) for s in range(run.at.global_step + 1, run.span.stop_at))


def _sample_generations(run: Run) -> list:
    """training.sample_prompts, generated greedily in the prompt format training used (RNG untouched)."""
    model, cfg = run.model, run.cfg
    was_training = model.training
    model.eval()
    loaded = Loaded(model, run.inputs.tokenizer, "adapter", prompt_format_of(run.inputs.data.shapes), run.where.device)
    options = SamplingOptions(max_new_tokens=cfg.training.sample_max_new_tokens, temperature=0.0)
    samples = [{"prompt": p, "text": generate(loaded, prompt_ids(loaded, prompt=p), options)} for p in cfg.training.sample_prompts]
    reshard(model)
    model.train(was_training)
    return samples
