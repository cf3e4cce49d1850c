"""slimtune vs PEFT on the real SmolLM2-135M-Instruct, on the CPU, in one run (issue 16).

Trains the `real_model` tests' settings (tests/real_model.SETTINGS: LoRA r=8 on all 210 attention and MLP
projections, batch 4, lr 2e-3 with 2 warmup steps and cosine to 0.1, clipping 1.0, bf16) for --steps steps
with `slimtune finetune` (NF4 base, one merged save at the end), then PEFT LoRA on the NF4-round-tripped
base (dequant(NF4(W)) as plain bf16 weights) from the same adapter initialisation on the same batches for
--peft-steps steps. Prints the training tokens/s of both (padded tokens per second of optimizer steps,
the first step excluded as warm-up), the step-loss difference over the common steps, and the eval losses
on the 60 held-out questions: original bf16 base, NF4 base, adapter form after --steps steps, the merged
model (recorded by the recipe) and the merged save reloaded by transformers. One JSON line at the end.

The machine's load average is printed with the figures: on a shared machine they are not quiet-machine figures.

Usage: python bench/real_model.py [--steps 50] [--peft-steps 11] [--out DIR]   (make bench-real)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.real_model: the model, data and PEFT reference the tests use

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from slimtune.config import load_config  # noqa: E402
from slimtune.data import DataSpec, load_data  # noqa: E402
from slimtune.recipes.finetune import run_finetune  # noqa: E402
from tests.real_model import (  # noqa: E402
    ensure_real_model,
    eval_loss,
    finetune_overrides,
    initial_adapters,
    nf4_round_trip_base,
    peft_lora_model,
    peft_train,
    write_docstring_data,
)


def _bf16(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)


def bench(steps: int, peft_steps: int, out: Path) -> dict:
    base = ensure_real_model()
    train, held_out = write_docstring_data(out / "data")
    cfg = load_config("tiny", finetune_overrides(base, train, held_out, out / "run", steps))
    load_before = os.getloadavg()
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_finetune(cfg)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:]  # the first step warms up (allocations, thread pools)
    ours_tok_s = sum(r["tokens_per_s"] * r["step_s"] for r in timed) / sum(r["step_s"] for r in timed)

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    data = load_data(DataSpec.from_config(cfg), tokenizer)
    round_trip = nf4_round_trip_base(base, result.model, out / "base_nf4")
    peft_model = peft_lora_model(round_trip, initial_adapters(base))
    del result
    peft_losses, peft_tok_s = peft_train(peft_model, data.train, tokenizer.pad_token_id, peft_steps, steps)
    del peft_model
    load_after = os.getloadavg()

    pad = tokenizer.pad_token_id
    final = metrics[-1]
    figures = {
        "steps": steps,
        "tokens_per_s_slimtune_nf4": round(ours_tok_s, 1),
        "tokens_per_s_peft_bf16_round_trip": round(peft_tok_s, 1),
        "peft_steps": peft_steps,
        "step_loss_max_abs_diff_vs_peft": round(max(abs(a - r["loss"]) for a, r in zip(peft_losses, metrics, strict=False)), 5),
        "eval_loss_base_bf16": round(eval_loss(_bf16(base), data.eval, pad), 4),
        "eval_loss_base_nf4": round(eval_loss(_bf16(round_trip), data.eval, pad), 4),
        "eval_loss_adapter_form": round(final["eval_loss"], 4),
        "eval_loss_merged": round(final["eval_loss_merged"], 4),
        "eval_loss_merged_reloaded": round(eval_loss(_bf16(result_ckpt(out)), data.eval, pad), 4),
        "train_loss_first_last": [round(metrics[0]["loss"], 4), round(final["loss"], 4)],
        "load_average_1min_before_after": [round(load_before[0], 1), round(load_after[0], 1)],
        "cpu_threads": torch.get_num_threads(),
    }
    return figures


def result_ckpt(out: Path) -> Path:
    (ckpt,) = sorted((out / "run").glob("step-*"))[-1:]
    return ckpt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="slimtune training steps (default 50)")
    parser.add_argument("--peft-steps", type=int, default=11, help="PEFT steps, the first untimed (default 11)")
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="slimtune-bench-real-") as tmp:
        out = args.out or Path(tmp)
        figures = bench(args.steps, args.peft_steps, out)
    for key, value in figures.items():
        print(f"{key:36s} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
