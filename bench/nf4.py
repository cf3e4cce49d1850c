"""``python -m bench nf4``: NF4 dequantization throughput, torchao's against slimtune's row-chunked lookup."""

from __future__ import annotations

import time

import torch

from slimtune.quant.nf4 import dequantize_nf4_rows, quantize_nf4


def bench_nf4(rows: int = 4096, cols: int = 14336, chunk_rows: int = 256, repeats: int = 3, device: str = "cpu") -> dict:
    """NF4 dequantization throughput: torchao's get_original_weight vs slimtune's row-chunked table
    lookup (as a save calls it) and the same lookup in one call (as ``nf4_linear`` calls it in training),
    on one weight (Llama-3-8B's MLP shape by default); bit-identity checked in the same run. On a GPU the
    chunked figure includes ~8 kernel launches per chunk, which the whole-tensor figure separates out."""

    weight = quantize_nf4((torch.randn(rows, cols, device=device) * 0.02).to(torch.bfloat16))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    reference = weight.get_original_weight()
    chunks = [dequantize_nf4_rows(weight, s, min(s + chunk_rows, rows)) for s in range(0, rows, chunk_rows)]
    identical = torch.equal(torch.cat(chunks).view(torch.int16), reference.view(torch.int16))
    del reference, chunks
    torchao_s = best(weight.get_original_weight)

    def chunked() -> None:  # as the save consumes it: one chunk at a time
        for s in range(0, rows, chunk_rows):
            dequantize_nf4_rows(weight, s, min(s + chunk_rows, rows))

    ours_s = best(chunked)
    whole_s = best(lambda: dequantize_nf4_rows(weight, 0, rows))  # one call: what nf4_linear does in training
    params = rows * cols
    return {
        "shape": [rows, cols],
        "device": device,
        "threads": torch.get_num_threads(),
        "torchao_mparams_s": round(params / torchao_s / 1e6, 1),
        "slimtune_mparams_s": round(params / ours_s / 1e6, 1),
        "speedup": round(torchao_s / ours_s, 2),
        "chunk_rows": chunk_rows,
        "slimtune_whole_mparams_s": round(params / whole_s / 1e6, 1),
        "whole_speedup": round(torchao_s / whole_s, 2),
        "bit_identical": identical,
    }
