"""``python -m bench step-profile --model DIR [--data FILE]``: where one training step's time goes, three ways,
on the same collated batches of the user's rows (the recipe's own, in its order), under torch.profiler:

- ``recipe``: the recipe's ``train_step`` itself (``setup`` + ``restore`` as ``slimtune finetune`` runs them:
  collation, token counts, the NF4 + LoRA forward and backward, the loss, clipping, AdamW, the schedule,
  the one host sync and the step's record);
- ``bare``: the same model, forward + backward + ``AdamW.step`` + ``zero_grad`` on the pre-collated batch,
  with the model's own loss, nothing else;
- ``held``: the recipe's step with every base weight's dequantized rows made once and held (an experiment,
  not something slimtune does: a dequantized copy of the model): the bound of what faster dequantization
  can buy, the recipe with its NF4 lookups free;
- ``bf16``: PEFT on the bf16 weights, the same bare loop (the bench's bf16 peer).

Each side runs ``--warmup`` steps unprofiled; then ``--rounds`` rounds of ``--steps`` unprofiled steps per
side, the sides alternated (each side's ``median_step_s`` is the median of those); then ``--steps`` profiled
steps per side. The table lists the operators and named regions (``record_function``) with the most self
CPU time per step. Figures from a loaded machine say so."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import slimtune.lora
from bench.train_step import peft_model, plain_step, recipe_config, recipe_plan
from slimtune.data import collate
from slimtune.recipes.finetune import setup, train_step
from slimtune.recipes.run_steps import restore
from slimtune.runtime import choose_num_threads


def _table(prof, steps: int, rows: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {"name": e.key[:60], "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2), "share": round(e.self_cpu_time_total / total, 3)}
        for e in events[:rows]
    ]


@contextlib.contextmanager
def _held_dequantization(held: dict):
    """Within the block, every base weight's rows are dequantized once and kept in ``held`` across blocks
    (``slimtune.lora.base_rows`` answered from it): the ``held`` side's experiment."""
    made = slimtune.lora.base_rows

    def base_rows(weight, start, end):
        key = (id(weight), start, end)
        if key not in held:
            held[key] = made(weight, start, end)
        return held[key]

    slimtune.lora.base_rows = base_rows
    try:
        yield
    finally:
        slimtune.lora.base_rows = made


def bench_step_profile(
    model_dir: Path, data: Path, out: Path, warmup: int = 4, steps: int = 3, rows: int = 18, threads: int | None = None, rounds: int = 3
) -> dict:
    """The four sides' step seconds and profile tables (module docstring).

    Example: ``bench_step_profile(Path(".cache/real-model/SmolLM2-135M-Instruct"), Path("train.jsonl"), Path("bench-out"))``"""
    threads = choose_num_threads(threads)
    cfg = recipe_config(model_dir, data, out / "step-profile-run", threads, {"logging.progress_bar": False})
    run = setup(cfg)
    restore(run)
    n = warmup + steps * (rounds + 1)
    examples = run.inputs.data.train
    plan = recipe_plan(examples, cfg, n)
    n = len(plan)
    collated = [collate([examples[i] for i in step[0]], run.inputs.pad_id) for step in plan]
    bare = plain_step(run.model, run.optim.optimizer)
    bf16 = peft_model(model_dir, cfg)
    peer = plain_step(bf16, torch.optim.AdamW([p for p in bf16.parameters() if p.requires_grad], lr=cfg.optimizer.lr))

    cache: dict = {}  # the held side's dequantized weights, made at its first step

    def held(i: int) -> None:
        with _held_dequantization(cache):
            train_step(run, plan[i % n])

    sides = {
        "recipe": lambda i: train_step(run, plan[i % n]),
        "held": held,
        "bare": lambda i: bare(collated[i % n]),
        "bf16": lambda i: peer(collated[i % n]),
    }
    for fn in sides.values():
        for i in range(warmup):
            fn(i)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            for i in range(warmup + r * steps, warmup + (r + 1) * steps):
                started = time.perf_counter()
                fn(i)
                seconds[name].append(time.perf_counter() - started)
    figures = {"bench": "step-profile", "model": str(model_dir), "data": str(data), "threads": threads, "warmup": warmup, "steps": steps}
    figures["rounds"] = rounds
    results = {}
    for name, fn in sides.items():
        first = warmup + rounds * steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(first, first + steps):
                fn(i)
        results[name] = {"median_step_s": round(statistics.median(seconds[name]), 4), "top": _table(prof, steps, rows)}
    figures["ratio_recipe_vs_bf16"] = round(results["bf16"]["median_step_s"] / results["recipe"]["median_step_s"], 3)
    figures["ratio_held_vs_bf16"] = round(results["bf16"]["median_step_s"] / results["held"]["median_step_s"], 3)
    return {**figures, **results}
