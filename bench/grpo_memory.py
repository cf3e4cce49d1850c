"""`python -m bench grpo-memory`: a GRPO step's peak RSS, generation included, against an SFT step's on the
same tokens, and what the reference pass adds (beta > 0 against beta = 0), on a synthetic base of a
preset's shape (``--layers`` of them, written once under ``--out`` with the byte-level tokenizer, as
step-memory's).

Three processes (``bench/step_memory_child.py``), one per configuration, so each VmHWM is its own:

- ``grpo-beta0``: ``--prompts`` prompts of ``--prompt-tokens`` bytes (= tokens; random words cut by
  grpo.max_prompt_length), ``--generations`` completions of each of at most ``--completion`` tokens sampled
  with the KV cache (the random model rarely samples eos, so nearly all run to the limit), the
  length-penalty reward, one optimizer step over every completion (dapo, beta 0);
- ``grpo-beta``: the same with grpo.beta ``--beta``: each step adds one no-grad forward through the
  adapters as loaded (``lora.swapped_adapters``), no second copy of the frozen weights;
- ``sft``: prompts x generations text rows (each prompt and more words), every one cut to the GRPO step's
  mean tokens per sequence, one optimizer step over all of them.

Peak RSS is VmHWM reset after the set-up, before the step (for GRPO: sampling, rewards, the reference pass
and the training step). Figures: each configuration's RSS before and peak, GRPO's rollout peak,
``grpo_over_sft_peak``, ``reference_over_beta0_peak`` (target < 1.05) and the MB it adds beside the frozen
weights' resident MB (what a second copy of the base would add)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from bench.common import run_child, synthetic_train_base
from bench.train_step import WORDS
from slimtune.data import write_jsonl

FIGURES = ("rss_before_steps_mb", "steps_peak_rss_mb", "tokens_per_step", "sequences_per_step")


def bench_grpo_memory(out: Path, preset: str = "llama3-8b", layers: int = 2, shape: dict | None = None) -> dict:
    """One JSON-able row; ``shape``: prompts, generations, prompt_tokens, completion, beta (the defaults below).

    Example: ``bench_grpo_memory(Path("bench-out"), "tiny", 2, dict(prompts=2, generations=2, completion=8))``"""
    shape = dict(prompts=2, generations=4, prompt_tokens=64, completion=32, beta=0.04) | (shape or {})
    out.mkdir(parents=True, exist_ok=True)
    base = synthetic_train_base(out, preset, layers)
    prompts, texts = _write_rows(out, shape)
    runs = {}
    for name, beta in (("grpo-beta0", 0.0), ("grpo-beta", shape["beta"])):
        values = _values(out, base, name, prompts) | {
            "training.objective": "grpo", "training.batch_size": shape["prompts"], "grpo.beta": beta,
            "grpo.num_generations": shape["generations"], "grpo.max_completion_length": shape["completion"],
            "grpo.max_prompt_length": shape["prompt_tokens"], "grpo.reward_funcs": ["length_penalty"],
        }  # fmt: skip
        runs[name] = run_child("bench.step_memory_child", json.dumps(values), what=f"the {name} step")
    grpo = runs["grpo-beta0"]
    per_sequence = round(grpo["tokens_per_step"] / grpo["sequences_per_step"])
    values = _values(out, base, "sft", texts) | {"training.batch_size": grpo["sequences_per_step"], "dataset.max_seq_len": per_sequence}
    runs["sft"] = run_child("bench.step_memory_child", json.dumps(values), what="the sft step")
    return _row(runs, preset, layers, shape)


def _write_rows(out: Path, shape: dict) -> tuple[Path, Path]:
    """The prompt rows (random words, longer than prompt_tokens) and the SFT text rows (each prompt
    ``generations`` times, followed by more words than a completion holds)."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"prompt": words(shape["prompt_tokens"] // 2)} for _ in range(shape["prompts"])]
    texts = [{"text": r["prompt"] + " " + words(shape["completion"])} for r in rows for _ in range(shape["generations"])]
    write_jsonl(out / "grpo-memory-prompts.jsonl", rows)
    write_jsonl(out / "grpo-memory-text.jsonl", texts)
    return out / "grpo-memory-prompts.jsonl", out / "grpo-memory-text.jsonl"


def _values(out: Path, base: Path, name: str, data: Path) -> dict:
    """The config values every configuration shares: one step on the CPU in bf16, no checkpoint."""
    return {
        "output_dir": str(out / f"grpo-memory-{name}"), "overwrite": True, "device": "cpu", "dtype": "bf16",
        "model.path": str(base), "model.create_tiny": False, "dataset.path": str(data), "dataset.create_builtin": False,
        "dataset.shuffle": False, "training.max_steps": 1, "checkpoint.merged": "never", "logging.progress_bar": False,
    }  # fmt: skip


def _row(runs: dict[str, dict], preset: str, layers: int, shape: dict) -> dict:
    """The printed row: every configuration's figures and the two ratios."""
    grpo, ref, sft = runs["grpo-beta0"], runs["grpo-beta"], runs["sft"]
    row = {"bench": "grpo-memory", "model": f"{preset}[{layers} layers], synthetic", **shape}
    row.update({f"{n}_{f}": round(v[f], 1) for n, v in runs.items() for f in FIGURES})
    row.update({f"{n}_rollout_peak_rss_mb": round(v["rollout_peak_rss_mb"], 1) for n, v in runs.items() if n != "sft"})
    row["completion_mean_length"] = round(grpo["completion_mean_length"], 1)
    row["generation_tokens_per_s"] = round(grpo["generation_tokens_per_s"], 2)
    row["step_s"] = {n: round(v["step_s"][0], 1) for n, v in runs.items()}
    row["grpo_over_sft_peak"] = round(grpo["steps_peak_rss_mb"] / sft["steps_peak_rss_mb"], 4)
    growth = {n: v["steps_peak_rss_mb"] - v["rss_before_steps_mb"] for n, v in runs.items()}
    row["grpo_over_sft_growth"] = round(growth["grpo-beta0"] / growth["sft"], 4)
    row["reference_over_beta0_peak"] = round(ref["steps_peak_rss_mb"] / grpo["steps_peak_rss_mb"], 4)
    row["reference_added_mb"] = round(ref["steps_peak_rss_mb"] - grpo["steps_peak_rss_mb"], 1)
    row["frozen_weights_mb"] = round(grpo["frozen_weights_mb"], 1)
    row["load_average_1min_after"] = round(os.getloadavg()[0], 2)
    return row
