"""``python -m bench quant``: throughput of slimtune's GGML block quantizers (``slimtune.gguf.ggml``) in MB/s
of fp32 input, on one thread and on a pool of ``--threads``, beside the ``gguf`` package's numpy quantizer
(the legacy types: what the export used before) and ggml's own C (``ggml_quantize_chunk`` of the libggml
llama-cpp-python loads: what ``llama_model_quantize`` runs, one thread). Rows: Gaussian weights (std 0.02),
4096 wide; each figure the best of ``--rounds``, the three alternated. ``slimtune_1_thread_cpu``: the one-thread
figure by the thread's CPU time (``time.thread_time``), the measure that holds on a loaded machine;
``ggml_c_1_thread_cpu`` the same of ggml's C. slimtune's path (``slimtune.gguf.kquant_kernel.loop_status``: C, or
torch and why) is in ``path``."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from slimtune.gguf import ggml

_GGML_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _ggml_c():
    """ggml_quantize_chunk from llama-cpp-python's libggml, or None where the binding is missing."""
    try:
        import llama_cpp._ggml
    except ImportError:
        return None
    lib = llama_cpp._ggml.libggml
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    args = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_chunk.argtypes = args
    return lib


def _best(fn, rounds: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def bench_quant(rows: int = 256, threads: int = 2, rounds: int = 3) -> dict:
    """MB/s of fp32 input per type: slimtune on 1 thread and on ``threads``, gguf's numpy, ggml's C.
    Example: ``bench_quant(rows=64, rounds=1)["Q4_K"]["slimtune_1_thread"]``"""
    import gguf

    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    mb = x.numel() * 4 / 1e6
    lib, out = _ggml_c(), {}
    a = np.ascontiguousarray(x.numpy())
    dst = np.zeros(a.size * 2, dtype=np.uint8)
    for name in _GGML_TYPE:
        figures = {
            "slimtune_1_thread": mb / _best(lambda n=name: ggml.quantize(x, n, threads=1), rounds),
            # this thread's CPU seconds: what the work costs, without the time a loaded machine preempts it
            "slimtune_1_thread_cpu": mb / _best(lambda n=name: ggml.quantize(x, n, threads=1), rounds, time.thread_time),
            f"slimtune_{threads}_threads": mb / _best(lambda n=name: ggml.quantize(x, n, threads=threads), rounds),
        }
        if not name.endswith("_K"):  # the package only dequantizes K-quants
            figures["gguf_numpy"] = mb / _best(lambda n=name: gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType[n]), rounds)
        if lib is not None:
            call = lambda n=name: lib.ggml_quantize_chunk(_GGML_TYPE[n], a.ctypes.data, dst.ctypes.data, 0, rows, 4096, None)  # noqa: E731
            figures["ggml_c_1_thread"] = mb / _best(call, rounds)
            figures["ggml_c_1_thread_cpu"] = mb / _best(call, rounds, time.thread_time)
        out[name] = {k: round(v, 1) for k, v in figures.items()}
    from slimtune.gguf import kquant_kernel

    return {"rows": rows, "width": 4096, "mb_fp32": round(mb, 1), "path": kquant_kernel.loop_status(), "MB_per_s": out}
