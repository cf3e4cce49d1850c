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
from torch.profiler import ProfilerActivity, profile

from bench.train_step import peft_model, plain_step, recipe_config, recipe_plan
from slimtune.data import collate
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
    cfg = recipe_config(model_dir, data, out / "step-profile-run", threads, {"logging.progress_bar": False})
    run = setup(cfg)
    restore(run)
    n = warmup + steps
    examples = run.inputs.data.train
    plan = recipe_plan(examples, cfg, n)
    collated = [collate([examples[i] for i in step[0]], run.inputs.pad_id) for step in plan]
    bare = plain_step(run.model, run.optim.optimizer)
    sides = {"recipe": lambda i: train_step(run, plan[i]), "bare": lambda i: bare(collated[i])}
    results = {name: _profiled(fn, warmup, steps, rows) for name, fn in sides.items()}
    bf16 = peft_model(model_dir, cfg)
    optimizer = torch.optim.AdamW([p for p in bf16.parameters() if p.requires_grad], lr=cfg.optimizer.lr)
    peer = plain_step(bf16, optimizer)
    results["bf16"] = _profiled(lambda i: peer(collated[i]), warmup, steps, rows)
    figures = {"bench": "step-profile", "model": str(model_dir), "data": str(data), "threads": threads, "warmup": warmup, "steps": steps}
    return {**figures, **results}


def _profiled(fn, warmup: int, steps: int, rows: int) -> dict:
    """``fn(i)`` for the first ``warmup`` indices timed, then ``steps`` more under torch.profiler: the median
    unprofiled step seconds (the first left out) and the table of the profiled steps."""
    seconds = _timed(fn, list(range(warmup + steps)), warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(warmup, warmup + steps):
            fn(i)
    return {"median_step_s": round(statistics.median(seconds[1:]), 4), "top": _table(prof, steps, rows)}
