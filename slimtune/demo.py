"""`slimtune demo`: the whole job on the embedded tiny model, offline: make a base checkpoint, load it as
QLoRA, train the adapters briefly, save (adapter + merged), reload with transformers and PEFT, report."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimtune.checkpoint.save import ADAPTER_DIR, save_checkpoint
from slimtune.lora import LoRAConfig, lora_parameters
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from slimtune.tiny import DEMO_TEXTS, make_tiny_checkpoint


def demo_batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


def run_demo(
    out_dir: str | Path = "slimtune-demo",
    base_dir: str | Path | None = None,
    steps: int = 60,
    lr: float = 1e-2,
    seed: int = 0,
    targets: list[str] | None = None,
) -> dict:
    out_dir = Path(out_dir).resolve()
    t0 = time.perf_counter()
    if base_dir is None:
        base_dir = out_dir / "base"
        if not (base_dir / "config.json").is_file():
            make_tiny_checkpoint(base_dir, seed=seed)
        print(f"embedded tiny Llama base written to {base_dir}")
    lora = LoRAConfig(rank=8, alpha=16) if targets is None else LoRAConfig(rank=8, alpha=16, target_modules=targets)
    model = load_qlora_model(base_dir, lora, seed=seed, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = demo_batch(tokenizer, DEMO_TEXTS)

    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=lr)
    model.train()
    losses = []
    for step in range(1, steps + 1):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 5 == 0 or step == steps:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    model.eval()

    ckpt = out_dir / "checkpoint"
    before = rss_mb()
    reset_peak_rss()
    result = save_checkpoint(model, ckpt, overwrite=True, progress=False)
    save_peak = peak_rss_mb()

    with torch.no_grad():
        qlora_logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        merged = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, local_files_only=True)
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    mask = batch["attention_mask"].bool()
    merged_diff = (qlora_logits - merged_logits)[mask].abs().max().item()
    peft_line = _peft_reload(base_dir, ckpt / ADAPTER_DIR)

    print(f"\ncheckpoint written to {ckpt}")
    for record in result.files:
        print(f"  {record.path:48s} {record.size:>12,d} bytes")
    print(f"  {'total':48s} {result.total_bytes:>12,d} bytes")
    summary = {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "save_s": result.seconds,
        "rss_before_save_mb": before,
        "peak_rss_during_save_mb": save_peak,
        "max_abs_logit_diff_merged": merged_diff,
    }
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps")
    print(f"save: {result.seconds:.2f} s, RSS before {before:.0f} MB, peak during save {save_peak:.0f} MB (+{save_peak - before:.0f} MB)")
    print(f"reloaded merged model with transformers: max |logit diff| vs in-memory QLoRA model = {merged_diff:.4f} (bf16)")
    print(peft_line)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; outputs under {out_dir}")
    return summary


def _peft_reload(base_dir: Path, adapter_dir: Path) -> str:
    try:
        from peft import PeftModel
    except ImportError:
        return "peft is not installed: adapter reload skipped (pip install peft)"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16, local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a deprecated transformers helper
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    n = sum(1 for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    return f"reloaded adapter with peft.PeftModel.from_pretrained: {n} LoRA modules on the original base"
