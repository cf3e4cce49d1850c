"""`python -m bench step-memory`: a preference (DPO) step's peak RSS against an SFT step's on the same 2N
sequences in one batch, on a synthetic base of a preset's shape (``--layers`` of them, written once under
``--out`` with the byte-level tokenizer, as train-step's). Each side runs in its own process
(``bench/step_memory_child.py``): set-up, then (DPO) the reference pass, then two optimizer steps over one
global batch of every row; peak RSS is VmHWM reset before the steps. The rows: N standard pairs of random
words, each prompt + answer longer than ``--seq`` bytes, so every sequence is cut to ``--seq`` tokens; the
SFT rows are the same 2N texts (prompt + chosen, prompt + rejected) as plain text rows, cut alike. The
reference pass holds no second model and keeps no activations (one no-grad forward per batch), so the DPO
step should hold what the SFT step holds: the figure is ``dpo_over_sft`` (peak over the RSS before the steps)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from bench.common import run_child, synthetic_train_base
from bench.train_step import WORDS
from slimtune.data import write_jsonl


def bench_step_memory(out: Path, preset: str = "llama3-8b", layers: int = 2, pairs: int = 2, seq: int = 256) -> dict:
    """One JSON-able row: each side's RSS before its steps and at their peak, and the DPO / SFT ratio of the growth.

    Example: ``bench_step_memory(Path("bench-out"), "tiny", layers=2, pairs=2, seq=64)``"""
    out.mkdir(parents=True, exist_ok=True)
    base = synthetic_train_base(out, preset, layers)
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"prompt": words(seq // 8), "chosen": " " + words(seq), "rejected": " " + words(seq)} for _ in range(pairs)]
    write_jsonl(out / "step-memory-pairs.jsonl", rows)
    write_jsonl(out / "step-memory-text.jsonl", [{"text": r["prompt"] + r[k]} for r in rows for k in ("chosen", "rejected")])
    sides = {}
    for objective, data, batch in (("sft", "text", 2 * pairs), ("dpo", "pairs", pairs)):
        values = {
            "output_dir": str(out / f"step-memory-{objective}"), "overwrite": True, "device": "cpu", "dtype": "bf16",
            "model.path": str(base), "model.create_tiny": False, "dataset.path": str(out / f"step-memory-{data}.jsonl"),
            "dataset.create_builtin": False, "dataset.max_seq_len": seq, "dataset.shuffle": False, "training.objective": objective,
            "training.batch_size": batch, "training.max_steps": 2, "checkpoint.merged": "never", "logging.progress_bar": False,
        }  # fmt: skip
        sides[objective] = run_child("bench.step_memory_child", json.dumps(values), what=f"the {objective} step")
    growth = {k: v["steps_peak_rss_mb"] - v["rss_before_steps_mb"] for k, v in sides.items()}
    return {
        "bench": "step-memory",
        "model": f"{preset}[{layers} layers], synthetic",
        "pairs": pairs,
        "seq": seq,
        **{f"{k}_{f}": round(v[f], 1) for k, v in sides.items() for f in ("rss_before_steps_mb", "steps_peak_rss_mb")},
        **{f"{k}_tokens_per_step": v["tokens_per_step"] for k, v in sides.items()},
        "dpo_reference_peak_rss_mb": round(sides["dpo"]["reference_peak_rss_mb"], 1),
        "dpo_reference_s": round(sides["dpo"]["reference_s"], 1),
        "step_s": {k: [round(s, 1) for s in v["step_s"]] for k, v in sides.items()},
        "sft_step_growth_mb": round(growth["sft"], 1),
        "dpo_step_growth_mb": round(growth["dpo"], 1),
        "dpo_over_sft_peak": round(sides["dpo"]["steps_peak_rss_mb"] / sides["sft"]["steps_peak_rss_mb"], 4),
        "dpo_over_sft_growth": round(growth["dpo"] / growth["sft"], 4),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
    }
