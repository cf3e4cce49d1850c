"""`python -m bench train-step`: slimtune's training step against PEFT's, in one process, runs
alternated (slimtune, peer, slimtune, peer, ...), so a machine whose load changes treats both alike.

The slimtune side is the recipe itself (``run_finetune``; its per-step ``step_s`` and ``tokens_per_s``
records, which time the whole step: collation, forward, loss, backward, clipping, AdamW, scheduler,
the logged loss and the step's bookkeeping). The peer is a plain PEFT loop on the same tokenized
batches in the same order: ``AutoModelForCausalLM`` in bf16 (not quantized), ``get_peft_model`` with
LoRA on all linear layers (fp32 adapters, PEFT's default), the model's own loss, the same clipping,
AdamW and ``loss.item()`` each step. Either side's figure is the median tokens/s of its steps after
the first two (warm-up), pooled over the rounds.

Without ``--model`` the base is synthetic, of a preset's shape (``--layers`` of them), written once under
``--out`` with the byte-level tokenizer (``bench.common.synthetic_train_base``); the data is random text,
packed into rows of ``--seq`` tokens.
With ``--model DIR`` it is that checkpoint and its tokenizer; rows of random words truncated to ``--seq``
tokens (every row the full length). Both are the fixed-batch mode: every step the same shape.

``--recipe`` (``bench_recipe_step``) is the user's case instead: the recipe run as ``slimtune finetune
--config tiny model.path=DIR dataset.path=FILE lora.rank=16 lora.alpha=32 training.max_steps=N`` runs
it (the user's rows and their lengths, shuffling, the chat template, logging, the progress bar,
metrics.jsonl, the default checkpoint settings: a merged save at the last step, outside the steps'
timing). Its figure is the recipe's own ``tokens_per_s``. Peers, each a plain loop on the same tokenized
batches in the same order (``_peft_steps``): PEFT on bf16 weights (``peft``) and PEFT +
bitsandbytes 4-bit NF4 QLoRA (``peft-bnb``: like for like). On every side tokens/s = the step's
non-padding tokens / its wall time, collation included; the runs alternate (recipe, peer, peer, recipe,
...) and each side's figure is the median of its steady steps (step 3 on) pooled over the rounds."""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from slimtune.config import load_config
from slimtune.data import DataSpec, collate, epoch_order, epoch_steps, load_data, model_inputs, write_jsonl
from slimtune.formats.hf import read_model_config
from slimtune.model import load_tokenizer
from slimtune.recipes import run_finetune
from slimtune.runtime import choose_num_threads
from slimtune.schedule import warmup_cosine

WORDS = "the of and to in is was for on that with as by at from his her an which this be are or had not but".split()


def bench_train_step(model_dir: Path, out: Path, shape: dict, rounds: int = 2, compile: bool = False, threads: int | None = None) -> dict:
    """One JSON-able row: both sides' median tokens/s, step seconds and the ratio (slimtune / peer).
    ``shape``: preset, layers, steps, batch, seq, rank; ``threads``: None picks as the recipe does.

    Example: ``bench_train_step(Path("base"), Path("bench-out"), dict(preset="tiny", layers=2, steps=4, batch=2, seq=64, rank=8))``"""
    out.mkdir(parents=True, exist_ok=True)
    threads = choose_num_threads(threads)  # once, for both sides: the recipe is told the same count
    data_path = out / f"train-step-data-{shape['seq']}.jsonl"
    _random_text(data_path, rows=shape["batch"] * (shape["steps"] + 1) * 4, words=shape["seq"] * 2)
    values = {**_config_values(model_dir, data_path, out / "train-step-run", shape, compile), "training.num_threads": threads}
    cfg = load_config("tiny", values=values)
    tokenizer = load_tokenizer(model_dir)
    examples = load_data(DataSpec.from_config(cfg), tokenizer, vocab_size=read_model_config(model_dir).vocab_size).train
    ours: list[float] = []
    peer: list[float] = []
    our_s: list[float] = []
    peer_s: list[float] = []
    load_before = os.getloadavg()[0]  # the machine's load from others: the figures say what they ran beside
    for _ in range(rounds):
        records = _slimtune_steps(cfg)
        ours += [r["tokens_per_s"] for r in records[2:]]
        our_s += [r["step_s"] for r in records[2:]]
        tok_s, step_s = _peft_steps(model_dir, examples, cfg, tokenizer)
        peer += tok_s[2:]
        peer_s += step_s[2:]
    shutil.rmtree(out / "train-step-run", ignore_errors=True)
    tokens = sum(len(e.input_ids) for e in examples[: shape["batch"]])
    return {
        "bench": "train-step",
        "model": str(model_dir) if shape.get("real") else f"{shape['preset']}[{shape['layers']} layers], synthetic",
        "batch": [shape["batch"], shape["seq"]],
        "tokens_per_step": tokens,
        "rank": shape["rank"],
        "steps": shape["steps"],
        "rounds": rounds,
        "threads": threads,
        "compile": compile,
        "slimtune_tok_s": round(statistics.median(ours), 1),
        "peft_tok_s": round(statistics.median(peer), 1),
        "slimtune_step_s": round(statistics.median(our_s), 3),
        "peft_step_s": round(statistics.median(peer_s), 3),
        "ratio": round(statistics.median(ours) / statistics.median(peer), 3),
        "slimtune_tok_s_all": [round(x, 1) for x in ours],
        "peft_tok_s_all": [round(x, 1) for x in peer],
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores",
        "load_average_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def bench_recipe_step(
    model_dir: Path,
    data: Path,
    out: Path,
    steps: int = 10,
    rounds: int = 2,
    peers: tuple[str, ...] = ("peft",),
    threads: int | None = None,
    objective: str = "sft",
) -> dict:
    """The user's case (module docstring): the recipe on ``data`` vs each of ``peers`` on its batches, alternated;
    ``objective`` dpo: ``data`` holds preference pairs and the peers are TRL's DPOTrainer (``_trl_dpo_steps``).

    Example: ``bench_recipe_step(Path(".cache/real-model/SmolLM2-135M-Instruct"), Path("train.jsonl"), Path("bench-out"), steps=10)``"""
    out.mkdir(parents=True, exist_ok=True)
    threads = choose_num_threads(threads)
    extra = {"training.max_steps": steps, "training.objective": objective}
    cfg = recipe_config(model_dir, data, out / "train-step-recipe-run", threads, extra)
    tokenizer = load_tokenizer(model_dir)
    examples = load_data(DataSpec.from_config(cfg), tokenizer, vocab_size=read_model_config(model_dir).vocab_size).train
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    tok_s: dict[str, list[float]] = {"slimtune": [], **{p: [] for p in peers}}
    step_s: dict[str, list[float]] = {k: [] for k in tok_s}
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        records = _slimtune_steps(cfg)
        tok_s["slimtune"] += [r["tokens_per_s"] for r in records[2:]]
        step_s["slimtune"] += [r["step_s"] for r in records[2:]]
        for peer in peers:
            if peer.startswith("trl"):
                t, s = _trl_dpo_steps(model_dir, rows, cfg, tokenizer, quantized=peer == "trl-bnb")
            else:
                t, s = _peft_steps(model_dir, examples, cfg, tokenizer, quantized=peer == "peft-bnb")
            tok_s[peer] += t[2:]
            step_s[peer] += s[2:]
    shutil.rmtree(out / "train-step-recipe-run", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    lengths = sorted(_tokens(e) for e in examples)
    return {
        "bench": "train-step --recipe" + (f" --objective {objective}" if objective != "sft" else ""),
        "model": str(model_dir),
        "data": str(data),
        "rows": len(examples),
        "row_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "batch": cfg.training.batch_size,
        "rank": cfg.lora.rank,
        "steps": steps,
        "rounds": rounds,
        "threads": threads,
        **{f"{k}_tok_s": round(v, 1) for k, v in med.items()},
        **{f"{k}_step_s": round(statistics.median(v), 4) for k, v in step_s.items()},
        **{f"ratio_vs_{p}": round(med["slimtune"] / med[p], 3) for p in peers},
        **{f"{k}_tok_s_all": [round(x, 1) for x in v] for k, v in tok_s.items()},
        "machine": f"CPU, {os.cpu_count()} cores",
        "load_average_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def _config_values(model_dir: Path, data_path: Path, run_dir: Path, shape: dict, compile: bool) -> dict:
    return {
        "output_dir": str(run_dir),
        "overwrite": True,
        "device": "cpu",
        "dtype": "bf16",
        "model.path": str(model_dir),
        "model.create_tiny": False,
        "dataset.path": str(data_path),
        "dataset.create_builtin": False,
        "dataset.max_seq_len": shape["seq"],
        "dataset.packed": not shape.get("real"),
        "lora.rank": shape["rank"],
        "lora.alpha": 2 * shape["rank"],
        "lora.target_modules": ["all-linear"],
        "training.batch_size": shape["batch"],
        "training.max_steps": shape["steps"],
        "training.compile": compile,
        "optimizer.lr": 1e-4,
        "scheduler.warmup_steps": 0,
        "checkpoint.merged": "never",
        "checkpoint.save_every_n_steps": None,
        "logging.progress_bar": False,
    }


def _slimtune_steps(cfg) -> list[dict]:
    records: list[dict] = []
    run_finetune(cfg, on_step=records.append)
    return records


def recipe_config(model_dir: Path, data: Path, run_dir: Path, threads: int, extra: dict | None = None):
    """The user's case as ``slimtune finetune --config tiny model.path=DIR dataset.path=FILE lora.rank=16
    lora.alpha=32`` sets it (``extra``: more keys), told ``threads``: train-step --recipe and step-profile."""
    values = {
        "output_dir": str(run_dir),
        "overwrite": True,
        "model.path": str(model_dir),
        "model.create_tiny": False,
        "dataset.path": str(data),
        "dataset.create_builtin": False,
        "lora.rank": 16,
        "lora.alpha": 32,
        "training.num_threads": threads,
        **(extra or {}),
    }
    return load_config("tiny", values=values)


def recipe_plan(examples: list, cfg, steps: int) -> list[list[list[int]]]:
    """The recipe's first ``steps`` in its order (seed, epoch 0, shuffle), one micro-batch of example indices each:
    what ``train_step(run, plan[i])`` takes; ``plan[i][0]`` the indices the peers collate."""
    return epoch_steps(epoch_order(len(examples), cfg.seed, 0, cfg.dataset.shuffle), cfg.training.batch_size, 1)[:steps]


def peft_model(model_dir: Path, cfg, quantized: bool = False) -> torch.nn.Module:
    """PEFT LoRA (the config's rank and alpha, no dropout) on all linears of ``model_dir`` in bf16, or (``quantized``)
    on bitsandbytes 4-bit NF4 weights with bf16 compute (QLoRA; on the CPU too with bitsandbytes >= 0.49), in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    extra = dict(quantization_config=BitsAndBytesConfig(**bnb), device_map="cpu") if quantized else {}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True, **extra)
    model = get_peft_model(base, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    return model


def plain_step(model: torch.nn.Module, optimizer, clip: tuple[list, float] | None = None, scheduler=None):
    """One plain loop step on a collated batch: the model's own loss, forward and backward, (``clip``: params and
    max norm) clipping, AdamW and zero_grad, (``scheduler``) its step, the loss read back; each part a named
    profiler region (forward, backward, adamw). The peers of train-step and the bare sides of step-profile."""

    def step(batch: dict) -> None:
        with record_function("forward"):
            loss = model(**model_inputs(batch), labels=batch["labels"]).loss
        with record_function("backward"):
            loss.backward()
        with record_function("adamw"):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(*clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        loss.item()

    return step


def _peft_steps(model_dir: Path, examples: list, cfg, tokenizer, quantized: bool = False) -> tuple[list[float], list[float]]:
    """A plain PEFT LoRA loop (``peft_model``, ``plain_step`` with the recipe's clipping and schedule) on the recipe's
    batches, in the recipe's order; tokens/s and seconds per step, collation included."""
    torch.manual_seed(cfg.seed)
    model = peft_model(model_dir, cfg, quantized)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    total = cfg.training.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 0, total, cfg.scheduler.min_lr_ratio))
    step = plain_step(model, optimizer, (params, cfg.training.max_grad_norm), scheduler)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    tok_s, step_s = [], []
    for (indices,) in recipe_plan(examples, cfg, total):
        started = time.perf_counter()
        batch = collate([examples[i] for i in indices], pad_id)
        step(batch)
        seconds = time.perf_counter() - started
        tok_s.append(int(batch["attention_mask"].sum()) / seconds)
        step_s.append(seconds)
    return tok_s, step_s


def _tokens(example) -> int:
    """The tokens of an SFT example, or of a pair's two sequences (chosen + rejected)."""
    if hasattr(example, "chosen"):
        return len(example.chosen.input_ids) + len(example.rejected.input_ids)
    return len(example.input_ids)


def _trl_dpo_steps(model_dir: Path, rows: list[dict], cfg, tokenizer, quantized: bool = False) -> tuple[list[float], list[float]]:
    """TRL 1.16's DPOTrainer on the recipe's batches, in the recipe's order: its tokenization of ``rows`` (the
    same ids as the recipe's, tests/test_preference.py), its collator, its ``compute_loss`` (the reference
    from the same model with the adapter disabled, one extra no-grad forward per step: TRL's default,
    precompute_ref_log_probs=False), a PEFT LoRA model as the trainer makes it from ``peft_config`` on bf16
    weights or (``quantized``) bitsandbytes 4-bit NF4 ones with bf16 compute (TRL prepares a 4-bit model
    for k-bit training itself); then the same clipping, AdamW and schedule as ``_peft_steps``, and the loss
    read back. tokens/s = the step's chosen + rejected non-padding tokens / its wall time, collation included."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(cfg.seed)
    bnb = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    extra = dict(quantization_config=BitsAndBytesConfig(**bnb), device_map="cpu") if quantized else {}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True, **extra)
    lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules="all-linear")
    p = cfg.preference
    args = DPOConfig(
        output_dir=str(Path(cfg.output_dir) / "trl"), beta=p.beta, loss_type=["sigmoid"], max_length=cfg.dataset.max_seq_len,
        truncation_mode=p.truncation_mode, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=cfg.training.batch_size, remove_unused_columns=False,
    )  # fmt: skip
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer = DPOTrainer(model=base, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=lora)
    model = trainer.model
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    total = cfg.training.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 0, total, cfg.scheduler.min_lr_ratio))
    tok_s, step_s = [], []
    for step in recipe_plan(rows, cfg, total):
        started = time.perf_counter()
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in step[0]])
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
        seconds = time.perf_counter() - started
        tok_s.append(int(inputs["attention_mask"].sum()) / seconds)
        step_s.append(seconds)
    return tok_s, step_s


def _random_text(path: Path, rows: int, words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    write_jsonl(path, [{"text": " ".join(rng.choice(WORDS) for _ in range(words))} for _ in range(rows)])


def print_row(row: dict) -> None:
    print(json.dumps(row), flush=True)
