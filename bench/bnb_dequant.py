"""``python -m bench bnb-dequant``: slimtune's dequantization of a bitsandbytes 4-bit weight (NF4, double
quantization, as training reads it: ``formats.bnb.BnbNF4Weight.rows``, the whole weight in one call) beside
bitsandbytes' own ``dequantize_4bit`` of the same bytes and slimtune's NF4 lookup of the same weight
quantized by torchao, alternated in rounds; bit-identity with bitsandbytes checked in the same run."""

from __future__ import annotations

import time

import torch

from slimtune.formats.bnb import BnbNF4Weight
from slimtune.quant.nf4 import dequantize_nf4_rows, quantize_nf4


def bench_bnb_dequant(rows: int = 1536, cols: int = 576, rounds: int = 3, repeats: int = 10) -> dict:
    """Seconds per whole-weight dequantization (the mean of ``repeats`` calls, the best of ``rounds``
    alternated rounds) of a [rows, cols] weight (SmolLM2-135M's up_proj by default)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    packed, qs = quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
    flat = packed.view(-1)
    nested = (qs.state2.code.float(), qs.state2.absmax.float(), qs.state2.blocksize, float(qs.offset))
    ours = BnbNF4Weight("w", (rows, cols), w.dtype, 64, qs.absmax, qs.code.float(), lambda a, b: flat[a:b], nested)
    nf4 = quantize_nf4(w)
    runs = {
        "slimtune_bnb": lambda: ours.rows(0, rows),
        "bitsandbytes": lambda: dequantize_4bit(packed, qs),
        "slimtune_nf4": lambda: dequantize_nf4_rows(nf4, 0, rows),
    }
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / repeats)
    identical = torch.equal(ours.rows(0, rows).view(torch.int16), dequantize_4bit(packed, qs).view(torch.int16))
    return {
        "shape": [rows, cols],
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(s, 5) for name, s in best.items()},
        "bnb_over_nf4": round(best["slimtune_bnb"] / best["slimtune_nf4"], 2),
        "bit_identical_to_bitsandbytes": identical,
    }
