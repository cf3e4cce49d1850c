"""`slimtune demo`: the whole job on the embedded tiny model, offline: the fine-tuning recipe with the
shipped ``tiny`` config (base checkpoint and built-in data made under the output directory, QLoRA load,
training with periodic checkpoints), then reload the merged model with transformers and the adapter
with PEFT, and report."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from slimtune.config import load_config
from slimtune.fileio import write_atomic
from slimtune.formats.hub import resolve_model
from slimtune.formats.layout import ADAPTER_DIR
from slimtune.formats.merge_source import MergeSource
from slimtune.generate import SamplingOptions, generate, load_for_generation, prompt_ids
from slimtune.recipes.finetune import run_finetune
from slimtune.tiny import DEMO_TEXTS


def demo_batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """``texts`` tokenized and padded on the tokenizer's side with its pad token (its eos when it has
    none: the tokenizer itself is left as it is), labels -100 on the padding."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    left = tokenizer.padding_side == "left"
    ids = [[pad_id] * (width - len(r)) + r if left else r + [pad_id] * (width - len(r)) for r in rows]
    mask = [[int(i >= width - len(r)) if left else int(i < len(r)) for i in range(width)] for r in rows]
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels}


def run_demo(
    out_dir: str | Path = "slimtune-demo",
    base_dir: str | Path | None = None,
    steps: int = 60,
    lr: float | None = None,
    seed: int = 0,
    targets: list[str] | None = None,
) -> dict:
    """The fine-tuning recipe with the shipped ``tiny`` config (tiny base and built-in data created under
    ``out_dir``), then the checks: reload the merged model with transformers, the adapter with PEFT."""
    out_dir = Path(out_dir).resolve()
    t0 = time.perf_counter()
    values = {"output_dir": str(out_dir), "training.max_steps": steps, "training.total_epochs": 10**6, "seed": seed, "overwrite": True}
    values["checkpoint.async"] = False  # the demo reports the peak RSS of the save itself, made in this process
    if base_dir is not None:  # a directory or a hub id
        values.update({"model.path": os.fspath(base_dir), "model.create_tiny": False})
    if targets is not None:
        values["lora.target_modules"] = targets
    if lr is not None:
        values["optimizer.lr"] = lr
    half = max(1, steps // 2)

    def report(record: dict) -> None:
        if record["step"] == 1 or record["step"] % 5 == 0 or record["step"] in (half, steps):
            print(f"step {record['step']:3d}  loss {record['loss']:.4f}", flush=True)

    # First half, stopped with a checkpoint as if the session had ended; then a second run resumes from
    # the newest complete checkpoint and continues exactly where the first stopped.
    first = run_finetune(load_config("tiny", values={**values, "training.stop_after_steps": half}), on_step=report)
    if half < steps:
        print(f"stopped after step {first.global_step}; resuming from {first.checkpoint.name} in a new recipe run", flush=True)
        cfg = load_config("tiny", values={**values, "overwrite": False, "resume": True})
        run = run_finetune(cfg, on_step=report)
        run.losses = first.losses + run.losses
        run.peak_rss_mb = max(run.peak_rss_mb, first.peak_rss_mb)
    else:
        cfg, run = load_config("tiny", values=values), first
    model, tokenizer, result = run.model, run.tokenizer, run.last_save
    base_dir = resolve_model(cfg.model.path).path  # resolved once already by the recipe (no second fetch)
    ckpt = out_dir / "checkpoint"
    _link(ckpt, run.checkpoint)
    batch = demo_batch(tokenizer, DEMO_TEXTS)

    device = next(p.device for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        qlora_logits = (
            model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits.float().cpu()
        )
        merged = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, local_files_only=True)
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    mask = batch["attention_mask"].bool()
    merged_diff = (qlora_logits - merged_logits)[mask].abs().max().item()
    peft_line = _peft_reload(base_dir, ckpt / ADAPTER_DIR, batch, qlora_logits)

    before, save_peak = run.rss_before_last_save_mb, run.peak_rss_last_save_mb
    print(f"\ncheckpoint written to {run.checkpoint} (linked as {ckpt})")
    for record in result.files:
        print(f"  {record.path:48s} {record.size:>12,d} bytes")
    print(f"  {'total':48s} {result.total_bytes:>12,d} bytes")
    summary = {
        "loss_first": run.losses[0],
        "loss_last": run.losses[-1],
        "save_s": result.seconds,
        "rss_before_save_mb": before,
        "peak_rss_during_save_mb": save_peak,
        "max_abs_logit_diff_merged": merged_diff,
        "peak_rss_mb": run.peak_rss_mb,
    }
    print(f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f} over {steps} steps")
    print(f"save: {result.seconds:.2f} s, RSS before {before:.0f} MB, peak during save {save_peak:.0f} MB (+{save_peak - before:.0f} MB)")
    print(f"reloaded merged model with transformers: max |logit diff| vs in-memory QLoRA model = {merged_diff:.4f} (bf16)")
    print(peft_line)
    print(f"peak RSS of the whole run: {run.peak_rss_mb:.0f} MB")
    summary["generated"] = _show_generate(out_dir, ckpt)
    _show_gguf(ckpt, out_dir / "model-f16.gguf", summary["generated"])
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; outputs under {out_dir}")
    return summary


def _link(link: Path, target: Path) -> None:
    """``out/checkpoint`` -> the newest ``step-N`` (relative, replaced atomically); an older demo's
    real ``checkpoint`` directory is removed first."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)

    def make(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.name, target_is_directory=True)

    write_atomic(link, make, suffix=f".link-{os.getpid()}")


def _show_generate(out_dir: Path, ckpt: Path) -> str:
    """What `slimtune generate` prints on the demo checkpoint, both forms (greedy, so they can be compared)."""
    prompt = "Can training resume?"
    rel = os.path.relpath(ckpt) if not os.path.relpath(ckpt).startswith("..") else str(ckpt)
    print(f"\n$ slimtune generate {rel} --prompt {prompt!r} --temperature 0 --max-new-tokens 24")
    options = SamplingOptions(max_new_tokens=24, temperature=0.0)
    merged = load_for_generation(MergeSource(checkpoint=ckpt), form="merged", device="cpu")
    text = generate(merged, prompt_ids(merged, prompt=prompt), options)
    ids = merged.tokenizer(text, add_special_tokens=False)["input_ids"]
    # the text as Python writes it, so spaces and newlines show (slimtune generate prints it plainly)
    print(f"{text!r}\n(token ids: {ids})")
    print(
        "(the demo model is a random tiny Llama trained for seconds: expect noise, often spaces or repeated "
        "characters; on a real model this is its answer)"
    )
    adapter = load_for_generation(MergeSource(checkpoint=ckpt), form="adapter", device="cpu")
    same = generate(adapter, prompt_ids(adapter, prompt=prompt), options) == text
    print(
        f"(merged model, {merged.prompt_format} format; the adapter on the NF4 base (--form adapter) gives "
        f"{'the same text' if same else 'a different text'}; try: slimtune chat {rel})"
    )
    return text


def _show_gguf(ckpt: Path, out: Path, transformers_text: str, prompt: str = "Can training resume?") -> None:
    """`slimtune export CKPT --format gguf` in a child process (its own peak RSS), then, where llama_cpp
    is installed, llama.cpp's greedy reply to the prompt next to transformers'."""
    import subprocess
    import sys

    rel = os.path.relpath(ckpt) if not os.path.relpath(ckpt).startswith("..") else str(ckpt)
    print(f"\n$ slimtune export {rel} --format gguf --type f16 --out {out} --overwrite")
    cmd = [sys.executable, "-m", "slimtune", "export", str(ckpt), "--format", "gguf", "--type", "f16", "--out", str(out), "--overwrite"]
    child = subprocess.run(cmd, capture_output=True, text=True)
    print((child.stdout + child.stderr).strip())
    if child.returncode:
        return
    try:
        import llama_cpp
    except ImportError:
        print("(llama-cpp-python is not installed: pip install -e .[dev] to see llama.cpp's reply)")
        return
    from slimtune.generate import load_for_generation, prompt_ids

    merged = load_for_generation(MergeSource(checkpoint=ckpt), form="merged", device="cpu")
    ids = prompt_ids(merged, prompt=prompt)
    llm = llama_cpp.Llama(str(out), verbose=False, n_ctx=256)
    reply = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        if token == llm.token_eos() or len(reply) >= 24:
            break
        reply.append(token)
    text = merged.tokenizer.decode(reply, skip_special_tokens=True)
    print(f"llama.cpp (greedy):    {text!r}")
    print(f"transformers (greedy): {transformers_text!r}")


def _peft_reload(base_dir: Path, adapter_dir: Path, batch: dict | None = None, qlora_logits: torch.Tensor | None = None) -> str:
    try:
        from peft import PeftModel  # optional (a dev extra): the demo's reload check only
    except ImportError:
        return "peft is not installed: adapter reload skipped (pip install peft)"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16, local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a deprecated transformers helper
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    n = sum(1 for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    line = f"reloaded adapter with peft.PeftModel.from_pretrained: {n} LoRA modules on the original base"
    if batch is not None and qlora_logits is not None:
        with torch.no_grad():
            logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        diff = (qlora_logits - logits)[batch["attention_mask"].bool()].abs().max().item()
        line += f" (max |logit diff| vs the QLoRA model = {diff:.4f}: W instead of dequant(NF4(W)))"
    return line
