"""``python -m bench.bnb_layout --model DIR``: the frozen-weight decision for bitsandbytes 4-bit bases, measured.
Either slimtune holds bnb's own layout (packed codes, per-64-block absmax, its nested quantization) and
dequantizes it as bitsandbytes does, or it converts the file's weight to torchao's NF4 once at load.

For each 2-D projection of the first ``--layers`` layers of a 16-bit checkpoint: quantize it with bitsandbytes
(NF4, double quantization, as ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)`` does),
then count the elements where each candidate's frozen weight differs from ``dequantize_4bit`` (the weight the
file holds and the only one there):

- ``native``: slimtune's reader of bnb's layout (formats/bnb.py);
- ``torchao_requantized``: torchao's NF4 of bnb's dequantized weight (``quantize_nf4``), dequantized by torchao;
- ``torchao_ideal_scalers``: the best any torchao NF4 can do with bnb's own codes: its dequantization multiplies a
  code by a block scaler in the compute dtype (bf16), so even with each block's scaler exactly bnb's absmax
  (rounded to bf16, no int8 double quantization) the products round differently from bnb's fp32 product.

Prints one JSON line: elements compared, differing elements and max |diff| per candidate, and bytes held per
weight element (packed codes + scales) for each layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slimtune.formats.bnb import BnbNF4Weight
from slimtune.formats.hf import checkpoint_files
from slimtune.formats.safetensors import SafetensorsReader
from slimtune.quant.nf4 import can_quantize, quantize_nf4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _count(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[int, float]:
    diff = (candidate.float() - reference.float()).abs()
    return int((candidate != reference).sum()), float(diff.max())


def bench_bnb_layout(model_dir: Path, layers: int = 2) -> dict:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    totals = {"native": [0, 0.0], "torchao_requantized": [0, 0.0], "torchao_ideal_scalers": [0, 0.0]}
    elements, bnb_bytes, torchao_bytes = 0, 0, 0
    for header in checkpoint_files(model_dir):
        with SafetensorsReader(header.path) as reader:
            for key in reader.tensors:
                parts = key.split(".")
                if not (key.endswith(".weight") and parts[-2] in PROJECTIONS and int(parts[2]) < layers):
                    continue
                w = reader.read(key).to(torch.bfloat16)
                if not can_quantize(w.shape):
                    continue
                packed, state = quantize_4bit(w, quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8)
                reference = dequantize_4bit(packed, state)
                absmax = (
                    state.state2.code.float()[state.absmax.long()]
                    * state.state2.absmax.float()[torch.arange(state.absmax.numel()) // state.state2.blocksize]
                    + state.offset.float()
                )
                read = lambda a, b, p=packed: p.view(-1)[a:b]  # noqa: E731
                native = BnbNF4Weight(key, tuple(w.shape), w.dtype, state.blocksize, absmax, state.code.float(), read)
                candidates = {
                    "native": native.rows(0, w.shape[0]),
                    "torchao_requantized": quantize_nf4(reference).get_original_weight(),
                    "torchao_ideal_scalers": _ideal_scalers(packed, state.code, absmax, w.shape),
                }
                for name, value in candidates.items():
                    n, m = _count(value, reference)
                    totals[name][0] += n
                    totals[name][1] = max(totals[name][1], m)
                elements += w.numel()
                bnb_bytes += packed.numel() + state.absmax.numel() + 4 * (state.state2.absmax.numel() + 256 + 16 + 1)
                nf4 = quantize_nf4(reference)
                held = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor)
                torchao_bytes += sum(t.numel() * t.element_size() for t in held)
    return {
        "bench": "bnb_layout",
        "model": str(model_dir),
        "layers": layers,
        "elements": elements,
        **{f"{name}_differing": n for name, (n, _) in totals.items()},
        **{f"{name}_max_abs_diff": m for name, (_, m) in totals.items()},
        "bnb_bytes_per_element": bnb_bytes / elements,
        "torchao_bytes_per_element": torchao_bytes / elements,
    }


def _ideal_scalers(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, shape) -> torch.Tensor:
    """bnb's own codes times each block's absmax, both in bf16 and multiplied in bf16, as torchao's NF4
    dequantization computes (codes and scalers in the tensor's dtype)."""
    flat = packed.view(-1)
    codes = torch.empty(flat.numel() * 2, dtype=torch.long)
    codes[0::2], codes[1::2] = flat >> 4, flat & 0xF
    values = code.to(torch.bfloat16)[codes[: shape[0] * shape[1]]].view(-1, 64)
    return (values * absmax.to(torch.bfloat16).unsqueeze(-1)).view(shape)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.bnb_layout")
    parser.add_argument("--model", type=Path, required=True, help="a 16-bit Hugging Face checkpoint directory")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(bench_bnb_layout(args.model, args.layers)))
