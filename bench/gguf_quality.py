"""What quantizing the merged fp32 rows buys (issue 25 item 3), on the real SmolLM2-135M-Instruct: the q4_k_m
file's top-1 agreement and KL divergence against transformers' fp32 forward of the fp32-merged model,
slimtune's route beside llama.cpp's.

- the adapter: by default a seeded random PEFT LoRA (r=8, alpha=16, every attention and MLP projection as
  tests/real_model.TARGETS; A as PEFT initialises it, B ~ N(0, --b-std)); or ``slimtune finetune`` of the
  `real_model` tests' settings for --steps steps (minutes per step on a loaded 2-core machine); or --adapter DIR;
- the reference: the base in fp32 with the adapter merged by PEFT (``merge_and_unload``) in fp32, no rounding;
- slimtune: ``slimtune export --base BASE --adapter A --type q4_k_m``: the merged fp32 rows quantized once;
- llama.cpp's route: the merged model rounded to bf16 (``slimtune export --type bf16``, the file llama.cpp's
  converter writes from a bf16 merged checkpoint: merge -> bf16 -> convert), then ``llama_model_quantize``
  (q4_k_m, no importance matrix) of that bf16 file;
- also the bf16 file itself, and the base alone (no adapter: its weights are bf16 already, so the two routes
  should give the same tensors: the bench counts the tensors whose type and bytes are equal).

Evaluated by llama.cpp (llama-cpp-python, weight repacking off as in the tests) on held-out chat rows of the
tests' data and a prose+code text; per position: KL(p_ref || p_file) in nats from the full-vocabulary
softmax, and whether the argmax agrees. One JSON line at the end; the load average is printed with it.

Usage: python -m bench gguf-quality [--b-std 0.01 | --steps N | --adapter DIR] [--rows 12] [--out DIR]
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.real_model: the model and data the tests use

TEXT = (
    "A checkpoint is an ordered stream of named tensors. Each tensor is produced on demand, a few rows at a time, "
    "so the memory holds one chunk and never the whole model. def merge(w, a, b): return w + b @ a  # fp32, one rounding"
)


def _llama_cpp():
    import llama_cpp

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():  # weight repacking off: it segfaults in decode on this machine (see docs/gguf.md)
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama.llama_cpp.llama_model_default_params = params
    return llama_cpp


def _sequences(tokenizer, held_out: Path, n_rows: int) -> list[list[int]]:
    import json

    rows = [json.loads(line) for line in held_out.read_text().splitlines()][:n_rows]
    seqs = [tokenizer.apply_chat_template(r["messages"], tokenize=True) for r in rows]
    seqs = [list(s["input_ids"] if isinstance(s, dict) or hasattr(s, "keys") else s) for s in seqs]
    return [tokenizer.encode(TEXT), *seqs]


def _reference_logits(base: Path, adapter: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()  # fp32 merge, no rounding
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].double().numpy() for s in seqs]


def _file_logits(llama_cpp, path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    llm = llama_cpp.Llama(str(path), logits_all=True, verbose=False, n_ctx=1024, n_threads=2)
    out = []
    for s in seqs:
        llm.reset()
        llm.eval(s)
        out.append(np.array(llm.scores[: len(s)], dtype=np.float64))
    llm.close()
    return out


def _compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    kl, agree = [], []
    for r, g in zip(ref, got, strict=True):
        lp = r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
        lq = g - np.logaddexp.reduce(g, axis=-1, keepdims=True)
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        agree.append(r.argmax(-1) == g.argmax(-1))
    kl, agree = np.concatenate(kl), np.concatenate(agree)
    return {
        "kl_mean": round(float(kl.mean()), 6),
        "kl_p99": round(float(np.quantile(kl, 0.99)), 5),
        "top1_agreement": round(float(agree.mean()), 4),
        "positions": int(kl.size),
    }


def _same_tensors(a: Path, b: Path) -> list[int]:
    """[tensors whose GGML type and data bytes are equal in both files, tensors] (the metadata's order may differ)."""
    import gguf

    ta, tb = {t.name: t for t in gguf.GGUFReader(a).tensors}, {t.name: t for t in gguf.GGUFReader(b).tensors}
    same = [n for n, t in ta.items() if n in tb and t.tensor_type == tb[n].tensor_type and bytes(t.data) == bytes(tb[n].data)]
    return [len(same), len(ta)]


def _export(args: list[str]) -> None:
    from slimtune.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        if main(["export", *args, "--overwrite"]) != 0:
            raise SystemExit(f"slimtune export {' '.join(args)} failed")


def _quantize(llama_cpp, src: Path, dst: Path) -> Path:
    from slimtune.gguf.mix import MIXES

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(MIXES["q4_k_m"][1]), 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize({src}) failed")
    return dst


def _train(base: Path, out: Path, steps: int) -> Path:
    from slimtune.config import load_config
    from slimtune.recipes.finetune import run_finetune
    from tests.real_model import finetune_overrides, write_docstring_data

    train, held_out = write_docstring_data(out / "data")
    overrides = finetune_overrides(base, train, held_out, out / "run", steps)
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_finetune(load_config("tiny", [*overrides, "checkpoint.merged=never"]))  # the adapter alone
    return Path(result.checkpoint) / "adapter"


def _random_adapter(base: Path, out: Path, b_std: float) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.real_model import TARGETS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std)
    peft_model.save_pretrained(out / "random-adapter")
    return out / "random-adapter"


def bench_gguf_quality(out: Path, steps: int = 0, adapter: Path | None = None, rows: int = 12, b_std: float = 0.01) -> dict:
    """The figures, as a dict (see the module docstring). Example: ``bench_gguf_quality(Path("bench-out"))``"""
    from transformers import AutoTokenizer

    from tests.real_model import ensure_real_model, write_docstring_data

    llama_cpp = _llama_cpp()
    base = ensure_real_model()
    load_before = os.getloadavg()
    _, held_out = write_docstring_data(out / "data")
    if adapter is not None:
        figures: dict = {"adapter": str(adapter)}
    elif steps:
        figures, adapter = {"adapter": f"slimtune finetune, {steps} steps (tests/real_model.SETTINGS)"}, _train(base, out, steps)
    else:
        figures, adapter = {"adapter": f"random LoRA r=8 alpha=16, B ~ N(0, {b_std}), seed 0"}, _random_adapter(base, out, b_std)
    seqs = _sequences(AutoTokenizer.from_pretrained(str(base)), held_out, rows)
    for label, adapted in (("with_adapter", adapter), ("base_only", None)):
        src = ["--base", str(base), "--adapter", str(adapter)] if adapted is not None else [str(base)]
        ours, bf16 = out / f"{label}-slimtune-q4_k_m.gguf", out / f"{label}-bf16.gguf"
        _export([*src, "--type", "q4_k_m", "--out", str(ours)])
        _export([*src, "--type", "bf16", "--out", str(bf16)])
        theirs = _quantize(llama_cpp, bf16, out / f"{label}-llama.cpp-bf16-q4_k_m.gguf")
        ref = _reference_logits(base, adapted, seqs)
        figures[label] = {
            "slimtune_q4_k_m_from_fp32": _compare(ref, _file_logits(llama_cpp, ours, seqs)),
            "llama_cpp_bf16_then_q4_k_m": _compare(ref, _file_logits(llama_cpp, theirs, seqs)),
            "bf16": _compare(ref, _file_logits(llama_cpp, bf16, seqs)),
            "q4_k_m_tensors_identical_of": _same_tensors(ours, theirs),
            "q4_k_m_bytes": ours.stat().st_size,
        }
    figures["load_average_1min_before_after"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    return figures
