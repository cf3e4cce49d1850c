"""Packing throughput: the tiny config fine-tuned on the same synthetic documents (lengths 10 to 250 tokens)
with dataset.packed=false and =true; prints non-padding tokens per second of training-step time (steps 4
on, the first ones warm up) and how many optimizer steps an epoch takes in each case.

    .venv/bin/python bench/packing.py [--steps 30] [--rows 600] [--max-seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import transformers

from slimtune.config import load_config
from slimtune.recipes.finetune import run_finetune
from slimtune.tiny import DEMO_TEXTS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    words = " ".join(DEMO_TEXTS).split()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "docs.jsonl"
        rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))} for _ in range(args.rows)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        figures = {}
        for packed in (False, True):
            out = Path(tmp) / f"packed-{packed}"
            values = {
                "output_dir": str(out),
                "dataset.path": str(data),
                "dataset.create_builtin": False,
                "dataset.packed": packed,
                "dataset.max_seq_len": args.max_seq_len,
                "training.batch_size": args.batch_size,
                "training.max_steps": args.steps,
                "training.total_epochs": 1000,
                "checkpoint.save_every_n_steps": None,
                "checkpoint.merged": "never",
                "logging.progress_bar": False,
            }
            records: list[dict] = []
            started = time.perf_counter()
            run_finetune(load_config("tiny", values=values), on_step=records.append)
            wall = time.perf_counter() - started
            steady = records[3:]  # the first steps warm up allocators and kernels
            tokens = sum(r["tokens_per_s"] * _step_seconds(r) for r in steady)
            seconds = sum(_step_seconds(r) for r in steady)
            figures[packed] = tokens / seconds
            epoch_one = sum(1 for r in records if r["epoch"] == 1)
            per_epoch = str(epoch_one) if records[-1]["epoch"] > 1 else f"more than {epoch_one}"
            print(
                f"packed={str(packed).lower():5s}: {tokens / seconds:8.0f} non-padding tokens/s over steps 4-{args.steps} "
                f"({per_epoch} steps per epoch; run wall {wall:.1f} s)"
            )
        print(f"packing speed-up: {figures[True] / figures[False]:.2f}x tokens/s")


def _step_seconds(record: dict) -> float:
    return record["step_s"]


if __name__ == "__main__":
    main()
