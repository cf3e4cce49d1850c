"""NF4 -> bf16 dequantization in C (``nf4_kernel.c``), bit-identical to torchao's, built once with the machine's
C compiler and loaded with ctypes; ``quant.nf4.dequantize_nf4_rows`` uses torch's ops where it cannot be.

Why hand-written: a QLoRA step dequantizes every frozen weight twice (forward, backward), and in torch that
is a gather, an index conversion and a multiply over every value (``dequantize_nf4_rows``): on short rows
it kept the CPU step below PEFT's bf16 step (figures: docs/benchmarks.md). Each 64-value block
has only 16 possible values, so the C makes them (torchao's float32 arithmetic, rounded to bf16 as torch
rounds) and looks the codes up in a register: a shuffle of a 16-entry table (AVX-512 BW ``vpermw``,
SSE4.1 ``pshufb``). No library does this for torchao's layout with torchao's bits: bitsandbytes' CPU
kernel looks up float32 NF4 levels (other bits than torchao's bf16 table), and ``torch.compile`` of the
same gather was slower than torch's eager ops.

Built and loaded by ``slimtune.native`` (once, into ``~/.cache/slimtune``; ``SLIMTUNE_NATIVE=0`` turns
it off). Without a compiler, on a CPU without SSE4.1 (not x86-64: no
vector loop is written for it yet), or on a failed build, torch's ops run, with the same bits;
``status()`` says which (``slimtune --version`` prints it)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import torch

from slimtune import native

__all__ = ["dequantize_bf16", "kind", "status"]

SOURCE = Path(__file__).with_name("nf4_kernel.c")
FLAGS = ("-O2", "-ffp-contract=off")  # no fused multiply-adds: torch's float32 operations, one rounding each
KINDS = {0: "plain C", 1: "SSE4.1", 2: "AVX-512 BW"}
_MIN_KIND = 1  # the plain C loop is slower than torch's ops: it only stands in for the vector loops in the tests


def _load() -> tuple[ctypes.CDLL | None, int, str]:
    lib, why = native.load(SOURCE, FLAGS)
    if lib is None:
        return None, -1, f"torch's ops ({why})"
    lib.slimtune_nf4_kind.restype = ctypes.c_int
    lib.slimtune_nf4_bf16.restype = None
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    lib.slimtune_nf4_bf16.argtypes = [pointer] * 4 + [count, pointer, pointer, count, count, ctypes.c_int]
    best = lib.slimtune_nf4_kind()
    if best < _MIN_KIND:
        return lib, best, f"torch's ops (no vector loop for this CPU, {platform.machine()})"
    return lib, best, f"C, {KINDS[best]}"


_library = native.once(_load)  # (library, ...status), once per process


def kind() -> int:
    """The vector loop this process runs (2 AVX-512 BW, 1 SSE4.1), or -1 where torch's ops run."""
    lib, best, _ = _library()
    return best if lib is not None and best >= _MIN_KIND else -1


def status() -> str:
    """One line: what dequantizes NF4 to bf16 here. Example: ``status()`` -> ``"C, AVX-512 BW"``"""
    return _library()[2]


def _plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return type(t) is torch.Tensor and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def dequantize_bf16(w, b0: int, b1: int, loop: int | None = None) -> torch.Tensor | None:
    """Blocks [b0, b1) of a bf16 NF4 weight as a flat bf16 tensor of (b1 - b0) * 64 values, torchao's bits;
    None where the C loop does not apply (no library, another dtype or device, inner tensors that are not
    plain contiguous CPU tensors of torchao's dtypes, arrays too short for the blocks): the caller then
    runs torch's ops, which also raise the error a malformed weight deserves. ``loop``: force one loop
    (0 plain C, 1 SSE4.1, 2 AVX-512 BW; at most what the CPU has), for the tests.

    Example: ``dequantize_bf16(quantize_nf4(w), 0, w.numel() // 64)  # == w's NF4 values, flat``"""
    lib, best, _ = _library()
    run = kind() if loop is None else loop
    if lib is None or run < 0 or run > best:
        return None
    codes, q, factor, mean, nf4 = w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4
    sbs, bs = w.scaler_block_size, w.block_size
    if not (
        w.dtype == torch.bfloat16
        and bs == 64
        and sbs > 0
        and 0 <= b0 <= b1
        and _plain(codes, torch.uint8)
        and _plain(q, torch.int8)
        and _plain(factor, torch.bfloat16)
        and _plain(mean, torch.bfloat16)
        and _plain(nf4, torch.bfloat16)
        and nf4.numel() == 16
        and mean.numel() == 1
        and codes.numel() >= b1 * 32
        and q.numel() >= b1
        and factor.numel() * sbs >= b1
    ):
        return None
    out = torch.empty((b1 - b0) * 64, dtype=torch.bfloat16)
    pointers = (codes.data_ptr(), q.data_ptr(), factor.data_ptr(), mean.data_ptr())
    lib.slimtune_nf4_bf16(*pointers, sbs, nf4.data_ptr(), out.data_ptr(), b0, b1, run)
    return out
