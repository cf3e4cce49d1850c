"""Which base to merge a QLoRA adapter into? Trains the tiny demo model's adapters with QLoRA (NF4 base),
then merges them offline into the original bf16 base and into dequant(NF4(base)), and compares each
merged model's logits and loss with the QLoRA model the adapter was trained in.

    .venv/bin/python bench/merge_base_example.py [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from slimtune import LoRAConfig, WriteOptions, load_qlora_model, save_checkpoint
from slimtune.formats.merge_source import MergeSource
from slimtune.lora import lora_parameters
from slimtune.merge import merge_from_files
from slimtune.tiny import DEMO_TEXTS, byte_tokenizer, make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = args.out or Path(tempfile.mkdtemp(prefix="slimtune-merge-base-"))
    base = make_tiny_checkpoint(out / "base", seed=0)
    model = load_qlora_model(base, LoRAConfig(rank=8, alpha=16), progress=False)
    enc = byte_tokenizer()(DEMO_TEXTS, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    for _ in range(args.steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    save_checkpoint(model, out / "qlora", WriteOptions(adapter_only=True, overwrite=True, progress=False))
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        reference = model(**batch).logits.float()
        results = {"qlora_loss": model(**batch, labels=labels).loss.item()}
        for merge_base in ("original", "quantized"):
            merged_dir = out / f"merged-{merge_base}"
            merge_from_files(MergeSource(base, out / "qlora", merge_base), merged_dir, WriteOptions(overwrite=True, progress=False))
            merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.bfloat16).eval()
            logits = merged(**batch).logits.float()
            results[f"{merge_base}_max_abs_logit_diff"] = round((logits - reference)[mask].abs().max().item(), 4)
            results[f"{merge_base}_mean_abs_logit_diff"] = round((logits - reference)[mask].abs().mean().item(), 4)
            results[f"{merge_base}_loss"] = merged(**batch, labels=labels).loss.item()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
