"""QLoRA fine-tuning on a local JSONL dataset: `slimtune finetune --config NAME_OR_PATH [key=value ...]`.

Read top to bottom: ``run_finetune`` is the whole recipe (set-up, training loop, checkpointing); the
helpers below it follow in the order it uses them.

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
bounded memory and atomically, with the recipe state inside them (optimizer, scheduler, loss scaler,
data position, each rank's RNG states, config), so ``resume=true`` continues bit-exactly where a
checkpoint was taken, in a new process, on the same number of ranks (on another number, it continues
through DCP's resharding). The run directory itself (step directories, resume point, pruning, leftovers,
metrics.jsonl) belongs to ``CheckpointManager``.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
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
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from tqdm.auto import tqdm

from slimtune.card import CardFacts, model_card
from slimtune.checkpoint.atomic import os_errors
from slimtune.checkpoint.fidelity import merged_forward
from slimtune.checkpoint.manager import STATE_FORMAT, CheckpointManager, CreatedByRun, MetricsLog, SaveOptions, rng_state, set_rng_state
from slimtune.checkpoint.save import ADAPTER_DIR, DTYPES, SaveResult
from slimtune.config import Config
from slimtune.data import (
    FALLBACK_CHAT_TEMPLATE,
    IGNORE_INDEX,
    DataSpec,
    builtin_tiny_records,
    collate,
    epoch_order,
    epoch_steps,
    load_data,
    model_inputs,
    write_jsonl,
)
from slimtune.distributed import Ranks, init_distributed, reshard, split_rows
from slimtune.errors import SlimtuneError
from slimtune.formats.hf import load_config as load_hf_config
from slimtune.formats.hf import tokenizer_files
from slimtune.formats.peft import lora_key
from slimtune.generate import FORMAT_NAME, format_record, prompt_format_of
from slimtune.lora import LoRAConfig, lora_modules, lora_parameters
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import config_dtype, load_qlora_model, nf4_report, nf4_summary_line
from slimtune.tiny import byte_tokenizer, make_tiny_checkpoint, tiny_config
from slimtune.tracking import Trackers


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


def run_finetune(cfg: Config, on_step: Callable[[dict], None] | None = None) -> FinetuneResult:
    """Train LoRA adapters on a QLoRA model as ``cfg`` says; ``on_step`` sees each step's metrics record.
    Under torchrun every rank calls this (it joins the process group). A fresh run that fails before its
    first checkpoint leaves nothing behind (CreatedByRun).

    Example: ``run_finetune(load_config("tiny", ["output_dir=out", "training.max_steps=5"]))``"""
    device = pick_device(cfg.device)
    ranks = init_distributed(device.type)
    created = CreatedByRun(Path(cfg.output_dir), [Path(cfg.model.path), Path(cfg.dataset.path)]) if ranks.is_coordinator else None
    try:
        return _finetune(cfg, on_step, ranks)
    except BaseException:
        if created is not None:
            created.undo(say)
        raise


def _finetune(cfg: Config, on_step: Callable[[dict], None] | None, ranks: Ranks) -> FinetuneResult:
    out = Path(cfg.output_dir)
    device = pick_device(cfg.device)
    if device.type == "cuda" and ranks.distributed:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed bound this rank to its GPU
    dtype = pick_dtype(cfg.dtype, device)
    if ranks.distributed and dtype == torch.float16:
        raise SlimtuneError("dtype fp16 (loss scaling) is for one process; with several ranks use bf16 or fp32")

    # --- Set-up 1: output_dir. Resume from its newest complete checkpoint, or refuse to mix two runs. ---
    manager = CheckpointManager(out, cfg.checkpoint.keep_last_n, log=say)
    resume = manager.find_resume_point(cfg.resume, cfg.overwrite)
    resume_dir, saved = (resume.path, resume.state) if resume is not None else (None, None)
    if resume is not None:
        manager.check_resumable(cfg, resume)

    # --- Set-up 2: tokenizer and data, read and tokenized row by row before the model is loaded (a bad row
    # fails in seconds, not minutes); then the step arithmetic. ---
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
    data = load_data(
        DataSpec.from_config(cfg),
        tokenizer,
        rows={str(dataset_path): builtin_rows} if builtin_rows is not None else None,
        vocab_size=getattr(hf_config, "vocab_size", None),
    )
    examples, eval_examples, dataset_sha = data.train, data.eval, data.sha256
    if saved is not None and saved["dataset_sha256"] != dataset_sha:
        raise SlimtuneError(f"cannot resume from {resume_dir}: the content of the data files changed since the checkpoint was taken")
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
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    steps_per_epoch = len(epoch_steps(list(range(len(examples))), cfg.training.batch_size, cfg.training.gradient_accumulation_steps))
    total_steps = cfg.training.total_epochs * steps_per_epoch
    if cfg.training.max_steps is not None:
        total_steps = min(total_steps, cfg.training.max_steps)
    if saved is not None and saved["num_examples"] != len(examples):
        raise SlimtuneError(
            f"cannot resume from {resume_dir}: the data tokenizes to {len(examples)} examples now, {saved['num_examples']} then"
        )

    # --- Set-up 4: the model, NF4 base + fp32 adapters, in the compute dtype, on the device. ---
    # Under a process group the model comes out FSDP2-sharded, NF4 base and adapters alike (model.py says how).
    lora = LoRAConfig(cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.use_rslora, list(cfg.lora.target_modules))
    progress = cfg.logging.progress_bar and ranks.is_coordinator
    model = load_qlora_model(model_dir, lora, seed=cfg.seed, progress=progress, ranks=ranks, dtype=dtype)
    say(f"lora targets ({', '.join(lora.target_modules)}): {', '.join(model.slimtune_targets)}")
    nf4 = nf4_report(model)
    say(nf4_summary_line(nf4))
    base_dtype = config_dtype(model.config)
    # None: each tensor in its own dtype (the base's, for NF4 weights), what the merged save writes by default
    merged_dtype = DTYPES[cfg.checkpoint.merged_dtype] if cfg.checkpoint.merged_dtype else (None if dtype == base_dtype else base_dtype)
    if not ranks.distributed:
        model.to(device)  # FSDP2 placed each rank's shards on its device already
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    params = lora_parameters(model)
    say(
        f"model: {model_dir.name}, {sum(p.numel() for p in params):,} trainable adapter parameters, {device.type}, "
        f"{str(dtype).removeprefix('torch.')}"
        + (f", {ranks.world_size} rank{'s' if ranks.world_size > 1 else ''} (FSDP2)" if ranks.distributed else "")
        + f"; data: {len(examples)} {'packed rows' if cfg.dataset.packed else 'examples'}"
        + (f" ({data.documents} documents)" if cfg.dataset.packed else "")
        + (f", {len(eval_examples)} held out" if eval_examples else "")
        + f", {steps_per_epoch} steps/epoch, {total_steps} steps"
    )

    # --- Set-up 5: optimizer (adapters only), warmup + cosine schedule, loss scaler (fp16 only). ---
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    lr_factor = partial(warmup_cosine, warmup=cfg.scheduler.warmup_steps, total=total_steps, min_ratio=cfg.scheduler.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # --- Set-up 6: a fresh output_dir, or everything restored from the checkpoint. Writing starts here. ---
    error = None
    if ranks.is_coordinator:
        try:
            manager.prepare(fresh_start=saved is None, overwrite=cfg.overwrite)
            if builtin_rows is not None:
                with os_errors("write the built-in dataset to", dataset_path):
                    write_jsonl(dataset_path, builtin_rows)
                say(f"built-in dataset written to {dataset_path}")
        except BaseException as e:  # noqa: BLE001 - every rank raises below
            error = e
    ranks.agree(error, "preparing output_dir")
    if saved is None:
        global_step, epoch, step_in_epoch = 0, 0, 0
        seed_everything(cfg.seed + ranks.rank)
    else:
        template = train_state(model, optimizer, scheduler, scaler, (0, 0), ranks)
        restored = manager.load_train_state(resume_dir, template)  # the adapters and optimizer state in place, resharded
        set_optimizer_state_dict(model, optimizer, restored["optimizer"])
        scheduler.load_state_dict(restored["scheduler"])
        for group in optimizer.param_groups:  # hyperparameters that may change on resume come from the config
            group["weight_decay"] = cfg.optimizer.weight_decay
        scheduler.base_lrs = [cfg.optimizer.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["lr"] = cfg.optimizer.lr * lr_factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        if scaler.is_enabled() and restored.get("grad_scaler"):
            scaler.load_state_dict(restored["grad_scaler"])
        global_step = saved["global_step"]
        epoch, step_in_epoch = restored["position"]["epoch"], restored["position"]["step_in_epoch"]
        world_then = saved.get("world_size", 1)
        if world_then != ranks.world_size:
            say(f"resume: the checkpoint was written by {world_then} rank(s), this run has {ranks.world_size}: state resharded by DCP")
        rng = restored.get("rng", {}).get(str(ranks.rank))
        if rng is not None:
            set_rng_state(rng)  # last: nothing may draw random numbers between here and the next step
        else:  # a rank the checkpoint did not have: a fresh stream of its own
            seed_everything(cfg.seed + ranks.rank + 1_000_003 * global_step)
        say(f"resumed from {resume_dir.name}: step {global_step}, epoch {epoch + 1}, step {step_in_epoch + 1} of the epoch next")
    docs = CheckpointDocs(tokenizer, cfg, data, hf_config, merged_dtype or base_dtype, nf4)  # tokenizer with its chat template, card
    metrics = (
        MetricsLog(manager.metrics_path, keep_through_step=global_step, last_record=saved.get("metrics") if saved else None)
        if ranks.is_coordinator
        else None
    )
    trackers = Trackers.from_config(cfg, out, resume_step=global_step) if ranks.is_coordinator else Trackers()
    prompt_format = prompt_format_of(data.shapes)
    memory = PeakMemory(device)
    result = FinetuneResult(model, tokenizer, out, global_step, metrics_path=manager.metrics_path)

    # --- Training loop. ---
    stop_at = total_steps if cfg.training.stop_after_steps is None else min(total_steps, cfg.training.stop_after_steps)
    if global_step >= stop_at:
        say(f"nothing to train: the run is at step {global_step} and stops at step {stop_at}")
    model.train()
    bar = tqdm(total=total_steps, initial=global_step, desc="train", unit="step", dynamic_ncols=True, disable=not progress)
    position = (epoch, step_in_epoch)
    first_step_of_invocation, last_eval = global_step + 1, None
    while global_step < stop_at:
        plan = epoch_steps(
            epoch_order(len(examples), cfg.seed, epoch, cfg.dataset.shuffle),
            cfg.training.batch_size,
            cfg.training.gradient_accumulation_steps,
        )
        for index in range(step_in_epoch, len(plan)):
            started = time.perf_counter()
            micro_batches = [rank_batch(examples, batch, ranks, pad_id) for batch in plan[index]]  # this rank's slices
            local_tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
            trained_tokens = int(all_sum(torch.tensor(float(local_tokens), device=device), ranks))  # the global step's
            loss_sum = torch.zeros((), device=device)
            tokens = 0
            for mb in micro_batches:
                mb = {k: v.to(device) for k, v in mb.items()}
                logits = model(**model_inputs(mb)).logits
                loss = token_loss_sum(logits, mb["labels"]) / trained_tokens  # summed over micro-batches: the step's token mean
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
                tokens += int(mb["attention_mask"].sum())
                del logits, loss
            lr = optimizer.param_groups[0]["lr"]
            scaler.unscale_(optimizer)
            if cfg.training.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            global_step += 1
            step_loss = all_sum(loss_sum, ranks).item()
            tokens = int(all_sum(torch.tensor(float(tokens), device=device), ranks).item())
            if not math.isfinite(step_loss) and not scaler.is_enabled():
                raise SlimtuneError(f"the loss is {step_loss} at step {global_step}; lower optimizer.lr or check the data")
            seconds = time.perf_counter() - started
            epoch_end = index + 1 == len(plan)
            position = (epoch + 1, 0) if epoch_end else (epoch, index + 1)
            record = {"step": global_step, "epoch": epoch + 1, "loss": step_loss, "lr": lr}
            record.update(tokens_per_s=tokens / seconds, step_s=seconds)
            if global_step == first_step_of_invocation and saved is not None:
                record["resumed_from"] = saved["global_step"]

            # --- Evaluation: every eval_every_n_steps and at every checkpoint; no RNG drawn, dropout off. ---
            every = cfg.checkpoint.save_every_n_steps
            checkpoint_now = epoch_end or (every is not None and global_step % every == 0) or global_step == stop_at
            eval_every = cfg.training.eval_every_n_steps
            adapter_only = cfg.checkpoint.merged == "never" or (cfg.checkpoint.merged == "final" and global_step < total_steps)
            if eval_examples and (checkpoint_now or (eval_every is not None and global_step % eval_every == 0)):
                last_eval = evaluate(model, eval_examples, cfg.training.batch_size, pad_id, device, ranks)
                if checkpoint_now and not adapter_only and not ranks.distributed:  # what the merge's rounding costs
                    with merged_forward(model, merged_dtype):
                        merged_eval = evaluate(model, eval_examples, cfg.training.batch_size, pad_id, device, ranks)
                    last_eval["eval_loss_merged"] = merged_eval["eval_loss"]
                record.update(last_eval)
            if checkpoint_now and cfg.training.sample_prompts:
                record["samples"] = sample_generations(model, tokenizer, cfg.training.sample_prompts, prompt_format, cfg, device)
                for sample in record["samples"]:
                    say(f"sample at step {global_step}: {sample['prompt']!r} -> {sample['text']!r}")  # every rank ran it: FSDP2 needs all

            # --- Checkpointing: each epoch end, every save_every_n_steps, and where this invocation stops. ---
            if checkpoint_now:
                state = recipe_state(cfg, global_step, dataset_sha, len(examples), total_steps, ranks)
                state["metrics"] = {**record, "checkpoint": manager.step_path(global_step).name}  # rewritten on resume if a kill takes it
                facts = dict(step=global_step, total_steps=total_steps, epoch=epoch + 1, train_loss=step_loss, merged=not adapter_only)
                extra = docs.files(eval=last_eval if "eval_loss" in record else None, **facts)
                options = SaveOptions(
                    adapter_only,
                    cfg.checkpoint.max_shard_size,
                    merged_dtype,
                    extra_files=extra,
                    tokenizer_dir=docs.tokenizer_dir,
                )
                ckpt = manager.step_path(global_step)
                training = train_state(model, optimizer, scheduler, scaler, position, ranks)
                save = partial(manager.save, model, global_step, state, options, training, ranks)
                saved_result, before, save_peak = memory.around_save(save)
                del training, save
                removed = manager.prune() if ranks.is_coordinator else []
                record.update(checkpoint=ckpt.name, checkpoint_save_s=saved_result.seconds, checkpoint_bytes=saved_result.total_bytes)
                record.update(checkpoint_peak_rss_mb=save_peak)
                kind = "adapter" if adapter_only else "adapter + merged"
                say(
                    f"saved {ckpt.name} ({kind}, {saved_result.total_bytes:,} bytes, {saved_result.seconds:.2f} s, "
                    f"peak RSS during save {save_peak:.0f} MB)" + (f"; removed {', '.join(removed)}" if removed else "")
                )
                result.checkpoint, result.last_save = ckpt, saved_result
                result.rss_before_last_save_mb, result.peak_rss_last_save_mb = before, save_peak
            record.update(memory.snapshot())
            if metrics is not None:
                metrics.write(record)
            trackers.log(record)
            result.losses.append(step_loss)
            bar.update(1)
            shown_eval = {"eval": f"{last_eval['eval_loss']:.4f}"} if last_eval else {}
            bar.set_postfix(loss=f"{step_loss:.4f}", **shown_eval, lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            if on_step is not None:
                on_step(record)
            if global_step >= stop_at:
                break
        epoch, step_in_epoch = position
    bar.close()
    trackers.close()
    docs.close()
    model.eval()

    # --- The end: loss curve, summary. ---
    result.global_step = global_step
    result.plot_path = plot_losses(manager.metrics_path, manager.plot_path) if ranks.is_coordinator else None
    snapshot = memory.snapshot()
    result.peak_rss_mb, result.peak_gpu_mb = snapshot["peak_rss_mb"], snapshot.get("peak_gpu_mb")
    if result.losses:
        first_step = global_step - len(result.losses) + 1
        evaluated = f"; eval loss {last_eval['eval_loss']:.4f} (perplexity {last_eval['eval_ppl']:.2f})" if last_eval else ""
        say(f"trained steps {first_step}-{global_step} of {total_steps}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}{evaluated}")
    if global_step < total_steps:
        say(f"stopped at step {global_step} (training.stop_after_steps); continue with resume=true")
    say(f"metrics: {manager.metrics_path}" + (f"; loss curve: {result.plot_path}" if result.plot_path else ""))
    if result.checkpoint is not None:
        say(f"newest checkpoint: {result.checkpoint}")
    gpu = f"; peak GPU memory {result.peak_gpu_mb:.0f} MB" if result.peak_gpu_mb is not None else ""
    say(f"peak RSS of the run: {result.peak_rss_mb:.0f} MB{gpu}")
    return result


# ---------------------------------------------------------------------------------------------------
# Set-up helpers


def say(message: str) -> None:
    """A log line on stdout that does not tear the progress bar; under torchrun only rank 0 speaks."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SlimtuneError("device is cuda but torch sees no CUDA GPU (use device=cpu or device=auto)")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 where the hardware has it, fp16 (with loss scaling) on GPUs without it."""
    if name == "auto":
        if device.type != "cuda":
            return torch.bfloat16
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "fp16" and device.type != "cuda":
        raise SlimtuneError("dtype fp16 is for GPUs without bf16; on the CPU use bf16 or fp32")
    return DTYPES[name]


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise SlimtuneError(f"{model_dir}: no usable tokenizer files ({e})") from None


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


def load_adapter_weights(model: nn.Module, path: Path) -> None:
    """The fp32 adapters from the checkpoint's PEFT file, bit for bit."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            for attr, peft_name in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                key = lora_key(name, peft_name)
                if key not in tensors:
                    raise SlimtuneError(f"{path}: no tensor {key}")
                getattr(module, attr).weight.copy_(tensors[key])


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


LOSS_CHUNK_BYTES = 64 * 2**20


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the trained (non -100) labels, in fp32, in chunks of positions
    that are recomputed in the backward pass: with a 128k vocabulary the fp32 logits of one 2048-token
    sequence are 1 GB, and their log-softmax and gradient as much again; here only one 64 MB chunk of
    fp32 exists at a time beside the model-dtype logits."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1; the last predicts nothing
    per_chunk = max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[-1] * logits.shape[0]))
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk, target in zip(logits.split(per_chunk, dim=1), targets.split(per_chunk, dim=1), strict=True):
        total = total + torch.utils.checkpoint.checkpoint(_chunk_loss_sum, chunk, target, use_reentrant=False, preserve_rng_state=False)
    return total


def _chunk_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def evaluate(model: nn.Module, examples: list, batch_size: int, pad_id: int, device: torch.device, ranks: Ranks) -> dict:
    """Token-mean loss and perplexity over the held-out examples: dropout off, no gradient, and the RNG
    state forked around it, so training continues exactly as without evaluation. Each rank evaluates its
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


def sample_generations(model: nn.Module, tokenizer, prompts: list[str], prompt_format: str, cfg: Config, device: torch.device) -> list:
    """training.sample_prompts, generated greedily in the prompt format training used (RNG untouched)."""
    from slimtune.generate import Loaded, SamplingOptions, generate, prompt_ids

    was_training = model.training
    model.eval()
    loaded = Loaded(model, tokenizer, "adapter", prompt_format, device)
    options = SamplingOptions(max_new_tokens=cfg.training.sample_max_new_tokens, temperature=0.0)
    samples = [{"prompt": p, "text": generate(loaded, prompt_ids(loaded, prompt=p), options)} for p in prompts]
    reshard(model)
    model.train(was_training)
    return samples


class CheckpointDocs:
    """What each checkpoint carries beside the weights: the tokenizer files with the chat template
    training rendered conversations with (the fallback one when the base tokenizer had none), the
    model card (README.md, at the root and in adapter/) and slimtune_format.json (the prompt format).
    Staged in a temporary directory and copied in by the save, under its manifest."""

    def __init__(self, tokenizer, cfg: Config, data, hf_config, base_dtype: torch.dtype, nf4: dict):
        self._tmp = tempfile.TemporaryDirectory(prefix="slimtune-docs-")
        self.root = Path(self._tmp.name)
        self.tokenizer_dir = self.root / "tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE  # what training used for chat rows; generation uses it too
        tokenizer.save_pretrained(str(self.tokenizer_dir))
        self.record = {**format_record(data.shapes, tokenizer.chat_template), "nf4": nf4}
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
            merged_dtype=str(base_dtype).removeprefix("torch."),
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
    tmp = png_path.with_name(png_path.name + ".partial.png")
    with os_errors("write the loss curve", png_path):
        try:
            fig.savefig(tmp)
            tmp.replace(png_path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
    return png_path
