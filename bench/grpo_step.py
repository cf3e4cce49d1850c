"""`python -m bench train-step --objective grpo --peer trl`: slimtune's GRPO step against TRL 1.16's
``GRPOTrainer`` on the real model, in one process, runs alternated (slimtune, TRL + bitsandbytes 4-bit,
TRL bf16, slimtune, ...), so a machine whose load changes treats every side alike.

Every side takes the same prompts in the same order (``prompts_per_step`` per step, single-digit sums as
the real-model GRPO test's, standard prompts), samples ``num_generations`` completions of each of at
most ``max_completion_length`` tokens at temperature 1 (stopping at the tokenizer's eos), scores them
with the same exact-answer reward and takes one optimizer step (dapo, beta 0, mu 1: TRL's defaults),
with LoRA r=16 on all linears, with the same threads.

- slimtune: the recipe itself (``run_finetune``, training.objective=grpo, the tiny config's dtype: bf16 on
  the CPU); its records' ``step_s`` (the whole step, generation included), ``generation_tokens_per_s``
  (completion tokens / sampling seconds) and ``tokens_per_s`` (prompt + completion tokens / step).
- TRL: ``GRPOTrainer`` with a PEFT LoRA model on bitsandbytes 4-bit NF4 weights with bf16 compute
  (``trl-bnb``) or on bf16 weights (``trl``); each step times ``_generate_and_score_completions`` (its
  ``model.generate``, rewards, advantages) and then ``compute_loss``, backward, clipping, AdamW.

Figures per side, medians over the steps after the first (warm-up), pooled over the rounds: generation
tokens/s, training tokens/s (prompt + completion tokens / the step's seconds outside generation) and the
whole step's seconds and tokens/s. Completion lengths differ between sides (each samples its own), so
tokens/s is the like-for-like figure; step seconds are printed beside them."""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from slimtune.recipes import run_finetune
from slimtune.runtime import choose_num_threads

EXACT = r"(-?\d+)"  # the completion's first number, compared with the answer column
LR = 2e-4  # AdamW's peak lr on every side, no warmup (the schedules differ: the step's speed does not depend on them)


def sum_prompts(count: int, seed: int = 0) -> list[dict]:
    """``count`` standard prompt rows "Question: What is a plus b?\\nAnswer:" with the sum as ``answer``.

    Example: ``sum_prompts(2)[0]["prompt"]``"""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]
    return [{"prompt": f"Question: What is {a} plus {b}?\nAnswer:", "answer": str(a + b)} for a, b in pairs]


def exact_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """TRL's reward signature: 1.0 where the completion's first number is the answer (the same check on every side)."""
    import re

    found = [re.search(EXACT, c) for c in completions]
    return [1.0 if m and m.group(1) == a.strip() else 0.0 for m, a in zip(found, answer, strict=True)]


def bench_grpo_step(model_dir: Path, out: Path, shape: dict, rounds: int = 1, threads: int | None = None) -> dict:
    """The GRPO step of slimtune vs TRL's (``trl-bnb``, ``trl``), alternated; ``shape``: steps, prompts,
    generations, completion (max_completion_length). Returns the row ``print_row`` prints.

    Example: ``bench_grpo_step(Path("SmolLM2-135M-Instruct"), Path("out"), dict(steps=4, prompts=4, generations=4, completion=16))``"""
    out.mkdir(parents=True, exist_ok=True)
    threads = choose_num_threads(threads)
    torch.set_num_threads(threads)
    rows = sum_prompts(shape["steps"] * shape["prompts"])
    data = out / "grpo-prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sides: dict[str, list[dict]] = {"slimtune": [], "trl-bnb": [], "trl": []}
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        for side in sides:
            steps = _slimtune_steps(model_dir, data, out, shape, threads) if side == "slimtune" else None
            steps = steps or _trl_steps(model_dir, rows, out, shape, quantized=side == "trl-bnb")
            sides[side] += steps[1:]
            print(f"{side}: {json.dumps([{k: round(v, 3) for k, v in s.items()} for s in steps])}", file=sys.stderr, flush=True)
    row = {"bench": "train-step --objective grpo --peer trl", "model": str(model_dir), **shape, "rounds": rounds, "threads": threads}
    for side, steps in sides.items():
        for key in ("generation_tok_s", "training_tok_s", "step_tok_s", "step_s", "completion_tokens"):
            row[f"{side}_{key}"] = round(statistics.median(s[key] for s in steps), 3)
    for peer in ("trl-bnb", "trl"):
        row[f"step_tok_s_ratio_vs_{peer}"] = round(row["slimtune_step_tok_s"] / row[f"{peer}_step_tok_s"], 3)
    row["machine"] = f"CPU, {os.cpu_count()} cores"
    row["load_average_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return row


def _figures(gen_s: float, step_s: float, completion_tokens: int, tokens: int) -> dict:
    return {
        "generation_tok_s": completion_tokens / gen_s,
        "training_tok_s": tokens / max(step_s - gen_s, 1e-9),
        "step_tok_s": tokens / step_s,
        "step_s": step_s,
        "completion_tokens": completion_tokens,
    }


def _slimtune_steps(model_dir: Path, data: Path, out: Path, shape: dict, threads: int) -> list[dict]:
    """The recipe's GRPO run on ``data``; each step's figures from its metrics record (sampling seconds =
    completion tokens / generation_tokens_per_s)."""
    from slimtune.config import load_config

    values = {
        "output_dir": str(out / "grpo-recipe-run"), "overwrite": True, "model.path": str(model_dir), "model.create_tiny": False,
        "dataset.path": str(data), "dataset.create_builtin": False, "dataset.shuffle": False, "lora.rank": 16, "lora.alpha": 32,
        "training.num_threads": threads, "training.objective": "grpo", "training.batch_size": shape["prompts"],
        "training.max_steps": shape["steps"], "grpo.num_generations": shape["generations"],
        "grpo.max_completion_length": shape["completion"], "grpo.reward_funcs": ["bench.grpo_step:exact_reward"],
        "optimizer.lr": LR, "scheduler.warmup_steps": 0, "checkpoint.merged": "never", "checkpoint.save_every_n_steps": None,
        "logging.progress_bar": False,
    }  # fmt: skip
    records: list[dict] = []
    run_finetune(load_config("tiny", values=values), on_step=records.append)
    figures = []
    for r in records:
        completion = round(r["completions/mean_length"] * shape["prompts"] * shape["generations"])
        figures.append(_figures(completion / r["generation_tokens_per_s"], r["step_s"], completion, round(r["tokens_per_s"] * r["step_s"])))
    return figures


def _trl_steps(model_dir: Path, rows: list[dict], out: Path, shape: dict, quantized: bool) -> list[dict]:
    """TRL's GRPOTrainer (PEFT LoRA on bitsandbytes 4-bit or bf16 weights), its generation and loss, step by step."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    bnb = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    extra = dict(quantization_config=BitsAndBytesConfig(**bnb), device_map="cpu") if quantized else {}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True, **extra)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    count = shape["prompts"] * shape["generations"]
    args = GRPOConfig(
        output_dir=str(out / "trl-grpo"), num_generations=shape["generations"], max_completion_length=shape["completion"],
        per_device_train_batch_size=count, report_to=[], use_cpu=True, bf16=False, logging_steps=1, temperature=1.0,
        learning_rate=LR, max_grad_norm=1.0, gradient_checkpointing=False,  # as slimtune's tiny config (TRL's default: on)
    )  # fmt: skip
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    dataset = Dataset.from_list(rows)
    trainer = GRPOTrainer(
        model=base, reward_funcs=[exact_reward], args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora
    )
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    figures = []
    for step in range(shape["steps"]):
        prompts = rows[step * shape["prompts"] : (step + 1) * shape["prompts"]]
        started = time.perf_counter()
        inputs = trainer._generate_and_score_completions([r for r in prompts for _ in range(shape["generations"])])
        generated = time.perf_counter()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        ended = time.perf_counter()
        completion = int(inputs["completion_mask"].sum())
        figures.append(_figures(generated - started, ended - started, completion, completion + int(inputs["prompt_mask"].sum())))
    return figures
