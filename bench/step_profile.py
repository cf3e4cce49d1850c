"""``python -m bench step-profile --model DIR [--data FILE]``: where one training step's time goes, three ways,
on the same collated batches of the user's rows (the recipe's own, in its order), under torch.profiler:

- ``recipe``: the recipe's ``train_step`` itself (``setup`` + ``restore`` as ``slimtune finetune`` runs them:
  collation, token counts, the NF4 + LoRA forward and backward, the loss, clipping, AdamW, the schedule,
  the one host sync and the step's record);
- ``bare``: the same model, forward + backward + ``AdamW.step`` + ``zero_grad`` on the pre-collated batch,
  with the model's own loss, nothing else;
- ``bf16``: PEFT on the bf16 weights, the same bare loop (the bench's bf16 peer).

Each side runs ``--warmup`` steps unprofiled, then ``--steps`` profiled; the table lists the operators and
named regions (``record_function``) with the most self CPU time per step, and each side's median step
seconds (unprofiled, before the profiled ones). Figures from a loaded machine say so."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from slimtune.config import load_config
from slimtune.data import collate, epoch_order, epoch_steps, model_inputs
from slimtune.recipes.finetune import setup, train_step
from slimtune.recipes.steps import restore
from slimtune.runtime import choose_num_threads


def _table(prof, steps: int, rows: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {"name": e.key[:60], "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2), "share": round(e.self_cpu_time_total / total, 3)}
        for e in events[:rows]
    ]


def _timed(fn, batches: list, warmup: int) -> list[float]:
    seconds = []
    for b in batches[:warmup]:
        started = time.perf_counter()
        fn(b)
        seconds.append(time.perf_counter() - started)
    return seconds


def bench_step_profile(
    model_dir: Path, data: Path, out: Path, warmup: int = 4, steps: int = 3, rows: int = 18, threads: int | None = None
) -> dict:
    """The three sides' step seconds and profile tables (module docstring).

    Example: ``bench_step_profile(Path(".cache/real-model/SmolLM2-135M-Instruct"), Path("train.jsonl"), Path("bench-out"))``"""
    threads = choose_num_threads(threads)
    values = {
        "output_dir": str(out / "step-profile-run"),
        "overwrite": True,
        "model.path": str(model_dir),
        "model.create_tiny": False,
        "dataset.path": str(data),
        "dataset.create_builtin": False,
        "lora.rank": 16,
        "lora.alpha": 32,
        "training.num_threads": threads,
        "logging.progress_bar": False,
    }
    cfg = load_config("tiny", values=values)
    run = setup(cfg)
    restore(run)
    examples = run.inputs.data.train
    plan = epoch_steps(epoch_order(len(examples), cfg.seed, 0, cfg.dataset.shuffle), cfg.training.batch_size, 1)
    n = warmup + steps
    plan = plan[:n]
    collated = [collate([examples[i] for i in step[0]], run.inputs.pad_id) for step in plan]
    results = {}

    def recipe(i: int) -> None:
        train_step(run, plan[i])

    model, optimizer = run.model, run.optim.optimizer

    def bare(i: int) -> None:
        b = collated[i]
        with record_function("forward"):
            loss = model(**model_inputs(b), labels=b["labels"]).loss
        with record_function("backward"):
            loss.backward()
        with record_function("adamw"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()

    sides = {"recipe": recipe, "bare": bare}
    for name, fn in sides.items():
        seconds = _timed(fn, list(range(n)), warmup)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(warmup, n):
                fn(i)
        results[name] = {"median_step_s": round(statistics.median(seconds[1:]), 4), "top": _table(prof, steps, rows)}
    results["bf16"] = _bf16_side(model_dir, cfg, collated, warmup, steps, rows)
    figures = {"bench": "step-profile", "model": str(model_dir), "data": str(data), "threads": threads, "warmup": warmup, "steps": steps}
    return {**figures, **results}


def _bf16_side(model_dir: Path, cfg, collated: list, warmup: int, steps: int, rows: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True)
    model = get_peft_model(base, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optimizer.lr)

    def step(i: int) -> None:
        b = collated[i]
        with record_function("forward"):
            loss = model(**model_inputs(b), labels=b["labels"]).loss
        with record_function("backward"):
            loss.backward()
        with record_function("adamw"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()

    seconds = _timed(step, list(range(warmup + steps)), warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(warmup, warmup + steps):
            step(i)
    return {"median_step_s": round(statistics.median(seconds[1:]), 4), "top": _table(prof, steps, rows)}
