"""ggml's K-quants (Q2_K ... Q6_K) and the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in C (``kquant_kernel.c``), byte for
byte what ggml's reference quantizers write, built once with the machine's C compiler and loaded with ctypes (``slimtune.native``);
``slimtune.gguf.kquants`` (and ``slimtune.gguf.ggml`` for the legacy types) quantizes in torch, with the
same bytes, wherever it cannot be.

Why hand-written: no Python library quantizes K-quants (the ``gguf`` package only dequantizes them), and
ggml's own quantizer needs a C++ build of llama.cpp (``llama_model_quantize``). The torch code vectorizes
the scale searches over blocks but stays several times slower than ggml's scalar C, whose searches are
short loops over 16 or 32 values held in registers (the legacy types' few passes in torch, too, ran at a
seventh of ggml's C). This file is that algorithm written again in C, with
ggml's float32 operations in ggml's order, compiled with ``-ffp-contract=off`` (no fused multiply-adds:
one rounding per operation, as ggml's reference quantizers are built), so its bytes are ggml's
(tests/test_kquants.py runs every byte-identity test on both paths). The K-quants' scale searches run
on 8 groups (sub-blocks) at once, one per lane of a vector (AVX2 code where the CPU has it, chosen at
run time; baseline code elsewhere): each lane does the scalar search's operations in its order, a
branch is a select, so the bytes stay ggml's at several times ggml's speed per core; the legacy
types' 32 values run 8 at a time in the same lanes (Q8_0 of bf16 widened in registers). ctypes releases
the GIL for the call.

``SLIMTUNE_NATIVE=0``, no compiler or a failed build: torch's code runs; ``loop_status()`` says which
(``slimtune --version`` prints it).

Example::

    out = quantize_blocks(torch.randn(4, 256), "Q4_K")   # uint8 (4, 144), or None where torch's code must run
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from slimtune import native
from slimtune.gguf.kquants import NonFiniteError

__all__ = ["c_fp16_bits", "loop_status", "quantize_bf16_blocks", "quantize_blocks", "runs"]

SOURCE = Path(__file__).with_name("kquant_kernel.c")
FLAGS = ("-O2", "-ffp-contract=off", "-fno-math-errno")  # one rounding per float operation; sqrtf inline
TYPES = {"Q2_K": (0, 84, 256), "Q3_K": (1, 110, 256), "Q4_K": (2, 144, 256), "Q5_K": (3, 176, 256), "Q6_K": (4, 210, 256)}
TYPES |= {"Q4_0": (5, 18, 32), "Q4_1": (6, 20, 32), "Q5_0": (7, 22, 32), "Q5_1": (8, 24, 32), "Q8_0": (9, 34, 32)}
"""type: (the C's number, block bytes, block values)."""


def _load(flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL | None, str]:
    """The library built with ``flags`` (the tests add ``-DSLIMTUNE_BASELINE_ONLY``: no AVX2 code), and "C";
    or None and "torch (why not)"."""
    lib, why = native.load(SOURCE, flags)
    if lib is None:
        return None, f"torch ({why})"
    pointer = ctypes.c_void_p
    lib.slimtune_kquant.restype = ctypes.c_int64
    lib.slimtune_kquant.argtypes = [ctypes.c_int, pointer, pointer, ctypes.c_int64]
    lib.slimtune_kquant_bf16.restype = ctypes.c_int64
    lib.slimtune_kquant_bf16.argtypes = [ctypes.c_int, pointer, pointer, ctypes.c_int64, ctypes.c_int]
    lib.slimtune_fp16_bits.restype = None
    lib.slimtune_fp16_bits.argtypes = [pointer, pointer, ctypes.c_int64]
    return lib, "C"


_library = native.once(_load)  # (library, ...status), once per process


def loop_status() -> str:
    """One line: what quantizes K-quants here. Example: ``loop_status()`` -> ``"C"`` or ``"torch (SLIMTUNE_NATIVE=0)"``"""
    return _library()[1]


def runs(type_name: str) -> bool:
    """Whether the C loop quantizes ``type_name`` here. Example: ``runs("Q4_K")`` -> ``True`` where it built"""
    return type_name in TYPES and _library()[0] is not None


def quantize_blocks(x: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """Blocks ``x`` (N, 256 for a K-quant, N, 32 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) quantized to ``type_name``: uint8
    (N, block bytes); None where the C loop does not run (then torch's code does, with the same bytes).
    ``FloatingPointError`` where a legacy block's fp16 scale overflows (as torch's code raises it).
    Example: ``quantize_blocks(torch.zeros(1, 256), "Q6_K").shape == (1, 210)``"""
    lib = _library()[0]
    if lib is None or type_name not in TYPES:
        return None
    code, size, _ = TYPES[type_name]
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], size, dtype=torch.uint8)
    if lib.slimtune_kquant(code, x.data_ptr(), out.data_ptr(), x.shape[0]):
        raise FloatingPointError("float16 overflow")
    return out


def quantize_bf16_blocks(x: torch.Tensor, type_name: str, check: bool = False) -> torch.Tensor | None:
    """``quantize_blocks`` of bf16 blocks ``x``, each widened to its float32 values inside the C loop (no
    float32 copy of ``x``); with ``check``, a NaN or an infinity in ``x`` is ``NonFiniteError`` before
    anything is quantized. None where the C loop does not run.
    Example: ``quantize_bf16_blocks(torch.zeros(1, 256, dtype=torch.bfloat16), "Q4_K").shape == (1, 144)``"""
    lib = _library()[0]
    if lib is None or type_name not in TYPES or x.dtype != torch.bfloat16:
        return None
    code, size, _ = TYPES[type_name]
    x = x.detach().contiguous()
    out = torch.empty(x.shape[0], size, dtype=torch.uint8)
    got = lib.slimtune_kquant_bf16(code, x.data_ptr(), out.data_ptr(), x.shape[0], int(check))
    if got == -2:
        raise NonFiniteError("NaN or infinite values")
    if got:
        raise FloatingPointError("float16 overflow")
    return out


def c_fp16_bits(x: torch.Tensor) -> torch.Tensor | None:
    """The C loop's fp32 -> fp16 bits of ``x`` (flat int32 0..65535), None without it (for the tests)."""
    lib = _library()[0]
    if lib is None:
        return None
    x = x.detach().to(torch.float32).contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.int16)
    lib.slimtune_fp16_bits(x.data_ptr(), out.data_ptr(), x.numel())
    return out.to(torch.int32) & 0xFFFF
