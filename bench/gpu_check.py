"""The measurements of bench/gpu_check.sh (issue 17), one JSON line each; see that script.

    python -m bench.gpu_check colab --out DIR [--smoke]       the seed's scenario: llama3-8b_qlora, 2 steps, merged save
    python -m bench.gpu_check train --out DIR [--smoke]       tokens/s and peak VRAM: slimtune eager / compiled, PEFT+bnb, PEFT bf16

``--smoke``: tiny shapes on the CPU (the dry run `make test` runs): the same code paths, figures meaningless.
A variant that fails prints {"error": ...} and the command exits 1 after the others ran; with --smoke a
peer whose library cannot run here (bitsandbytes on a CPU) prints {"skipped": reason} instead."""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from bench.common import child_env, disk_write_mb_s, synthetic_train_base
from slimtune.data import write_jsonl
from slimtune.lora import LoRAConfig
from slimtune.synthetic import preset_config, synthetic_qlora_model


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _text_rows(path: Path, rows: int, words: int) -> Path:
    rng = random.Random(0)
    vocab = "the of and to in is was for on that with as by at from his her an which this be are or".split()
    write_jsonl(path, [{"text": " ".join(rng.choice(vocab) for _ in range(words))} for _ in range(rows)])
    return path


def colab(out: Path, smoke: bool) -> int:
    """The shipped llama3-8b_qlora config on a synthetic Llama-3-8B (real shapes, random bf16 on this
    machine's disk), 2 optimizer steps, then the merged save; the recipe in a child process (its whole
    life's peak RSS), the disk's fsync'd write speed measured in the same run."""
    preset, device = ("tiny", "cpu") if smoke else ("llama3-8b", "cuda")
    t0 = time.perf_counter()
    base = synthetic_train_base(out, preset)
    write_s = time.perf_counter() - t0
    data = _text_rows(out / "colab.jsonl", rows=40, words=64 if smoke else 2048)
    run_dir = out / "colab-run"
    overrides = [f"output_dir={run_dir}", "overwrite=true", f"model.path={base}", f"dataset.path={data}", f"device={device}"]
    # the save measured in the trainer (its seconds vs the disk, the host's peak RSS with it): synchronous;
    # background saves are the train-save bench's (a writer process would hold its own host copy of NF4)
    overrides += ["training.max_steps=2", "checkpoint.merged=final", "checkpoint.async=false", "logging.progress_bar=false"]
    if smoke:
        overrides += ["training.gradient_accumulation_steps=2", "dataset.max_seq_len=64"]
    t0 = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "bench.colab_child", *overrides], stdout=subprocess.PIPE, text=True, env=child_env())
    wall = time.perf_counter() - t0
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode or not lines:
        sys.stdout.write(child.stdout[-4000:])
        emit({"check": f"colab-{preset}", "error": f"recipe exited {child.returncode}"})
        return 1
    stats = json.loads(lines[-1][len("RESULT ") :])
    disk = disk_write_mb_s(out, min(stats["save_bytes"], 2 * 1024**3))
    save_mb_s = stats["save_bytes"] / stats["save_s"] / 1e6
    shutil.rmtree(run_dir, ignore_errors=True)
    emit(
        {
            "check": f"colab-{preset}",
            "device": device,
            "config": "llama3-8b_qlora",
            **stats,
            "save_mb_s": round(save_mb_s, 1),
            "disk_mb_s": round(disk, 1),
            "save_ratio": round(save_mb_s / disk, 3),
            "base_write_s": round(write_s, 1),
            "recipe_wall_s": round(wall, 1),
        }
    )
    return 0


def _batches(vocab: int, batch: int, seq: int, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def _timed(step, batches: list[dict], warmup: int, device: torch.device) -> dict:
    """Run ``step(batch)`` (which reads its loss back) over warm-up then timed batches."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for b in batches[:warmup]:
        step(b)
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:])
    row = {"tok_s": round(tokens / seconds, 1), "timed_steps": len(batches) - warmup, "warmup_s": round(warm_s, 1)}
    if cuda:
        row["peak_vram_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row


def _slimtune(preset: str, layers: int | None, device: torch.device, compile: bool, batches: list[dict], warmup: int) -> dict:
    """The recipe's optimizer step (recipes.train_loop.optimizer_step over the SFT objective's micro-batch
    loss, what the recipe's train_step calls after collating) on a synthetic QLoRA model of the shape."""
    from slimtune.recipes.objective import StepBatches
    from slimtune.recipes.objectives.sft import SupervisedObjective
    from slimtune.recipes.run import StepParts
    from slimtune.recipes.train_loop import optimizer_step
    from slimtune.runtime import compile_decoder_layers, enable_activation_checkpointing
    from slimtune.schedule import warmup_cosine

    config = preset_config(preset, **({"num_hidden_layers": layers} if layers else {}))
    lora = LoRAConfig(rank=16, alpha=32, target_modules=["all-linear"])
    model = synthetic_qlora_model(config, lora).to(device)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    enable_activation_checkpointing(model)
    if compile:
        compile_decoder_layers(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=0, total=len(batches), min_ratio=0.1))
    parts = StepParts(model, optimizer, scheduler, torch.amp.GradScaler(device.type, enabled=False), params, 1.0, device)
    sft = SupervisedObjective(cfg=None)  # its loss needs no config

    def step(b: dict) -> None:
        trained = int((b["labels"][:, 1:] != -100).sum())
        optimizer_step(parts, sft, StepBatches([b], 0, {"trained_tokens": trained}))[0].item()

    return _timed(step, batches, warmup, device)


def _peft(base: Path, device: torch.device, bnb: bool, batches: list[dict], warmup: int) -> dict:
    """A plain PEFT loop: LoRA r=16 on all linears, activation checkpointing, the model's own loss, AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"dtype": torch.bfloat16, "device_map": {"": device.index or 0} if device.type == "cuda" else None}
    if bnb:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, **kwargs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step(b: dict) -> None:
        b = {k: v.to(device) for k, v in b.items()}
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return _timed(step, batches, warmup, device)


def _bnb_usable(device: torch.device) -> str | None:
    """Why bitsandbytes' 4-bit cannot run here, or None."""
    try:
        import bitsandbytes as bnb
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        w = torch.randn(64, 64, dtype=torch.bfloat16, device=device)
        q, state = quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        dequantize_4bit(q, state)
        return None if bnb is not None else "bitsandbytes missing"
    except Exception as e:  # noqa: BLE001 - any failure means: cannot run here
        return f"bitsandbytes 4-bit cannot run on {device.type}: {type(e).__name__}: {str(e)[:200]}"


def train(out: Path, smoke: bool) -> int:
    """Tokens/s and peak VRAM at each shape, seq 2048 x batch 2 (smoke: 64 x 2), r=16 all linears,
    activation checkpointing, warm-up then timed steps, every variant in this process in turn."""
    device = torch.device("cpu" if smoke else "cuda")
    shapes = [("tiny", None)] if smoke else [("llama3.2-1b", None), ("llama3-8b", None)]
    seq, batch, warmup, timed = (64, 2, 1, 2) if smoke else (2048, 2, 2, 10)
    failed = 0
    for preset, layers in shapes:
        base = synthetic_train_base(out, preset, layers)
        vocab = preset_config(preset).vocab_size
        batches = _batches(vocab, batch, seq, warmup + timed)
        no_bnb = _bnb_usable(device)
        variants = [
            ("slimtune-eager", partial(_slimtune, preset, layers, device, False, batches, warmup)),
            ("slimtune-compiled", partial(_slimtune, preset, layers, device, True, batches, warmup)),
            ("peft-bnb-qlora", partial(_peft, base, device, True, batches, warmup)),
            ("peft-bf16-lora", partial(_peft, base, device, False, batches, warmup)),
        ]
        for name, run in variants:
            row = {"check": "train", "shape": preset, "variant": name, "device": device.type, "seq": seq, "batch": batch, "rank": 16}
            if smoke and name == "slimtune-compiled":
                row["skipped"] = "compile on the CPU is checked by tests/test_runtime.py; its cold start is too slow for the smoke"
            elif name == "peft-bnb-qlora" and no_bnb is not None:
                row["skipped" if smoke else "error"] = no_bnb
                failed |= not smoke
            else:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    row.update(run())
                except Exception as e:  # noqa: BLE001 - reported; the other variants still run
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    failed = 1
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            emit(row)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("what", choices=["colab", "train"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        emit({"check": args.what, "error": "no CUDA device (use --smoke for the CPU dry run)"})
        sys.exit(1)
    sys.exit(colab(args.out, args.smoke) if args.what == "colab" else train(args.out, args.smoke))


if __name__ == "__main__":
    main()
