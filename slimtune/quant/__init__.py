"""Quantized frozen weights: torchao's NF4 (quantized by slimtune at load) and bitsandbytes 4-bit (as a
pre-quantized checkpoint stores it, ``quant.bnb4``), read through one interface: ``base_rows``,
``frozen_linear``, ``resident_bytes``. torchao costs ~80 MB of RSS to import, so paths that never meet an
NF4 tensor (the offline merge of a bf16 base) test for one without importing it."""

from __future__ import annotations

import sys

import torch

from slimtune.profiler import stage
from slimtune.quant.bnb4 import is_bnb4

_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")


def is_nf4(t: torch.Tensor) -> bool:
    """True for a torchao NF4Tensor. If torchao's NF4 module was never imported, none can exist."""
    for name in _NF4_MODULES:
        module = sys.modules.get(name)
        if module is not None and isinstance(t, module.NF4Tensor):
            return True
    return False


def base_rows(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows of a frozen base weight in its own dtype: NF4 dequantized exactly as torchao does, bitsandbytes
    4-bit exactly as bitsandbytes does."""
    if is_bnb4(weight):
        with stage("dequantize"):
            return weight.rows(start, end)
    if is_nf4(weight):
        # an NF4 tensor exists, so torchao is loaded already; slimtune.quant.nf4 imports it at its top
        from slimtune.quant.nf4 import dequantize_nf4_rows

        with stage("dequantize"):
            return dequantize_nf4_rows(weight, start, end)
    return weight.detach()[start:end]


def resident_bytes(weight: torch.Tensor) -> int:
    """Bytes a frozen base weight holds in memory: an NF4 weight's codes, scalers and their factors, else
    the tensor's own bytes.

    Example: ``sum(resident_bytes(p) for p in model.parameters()) / 2**20`` -> the loaded model's MB"""
    if is_nf4(weight):
        from slimtune.quant.nf4 import nf4_nbytes  # an NF4 tensor exists: torchao is loaded already

        return nf4_nbytes(weight)
    if is_bnb4(weight):
        return weight.nbytes_held()
    return weight.numel() * weight.element_size()


def is_quantized(t: torch.Tensor) -> bool:
    """True for a frozen weight held quantized (NF4 or bitsandbytes 4-bit): read it with ``base_rows``."""
    return is_bnb4(t) or is_nf4(t)


def frozen_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T for a frozen bitsandbytes 4-bit weight, differentiable in x, saving the 4-bit weight (not a
    dequantized copy) for the backward: W dequantized (``base_rows``), cast to x's dtype, one matmul each
    way, as bitsandbytes' own ``matmul_4bit`` does on the CPU. (NF4 weights: ``quant.nf4.nf4_linear``.)

    Example: ``y = frozen_linear(x, module.weight)``"""
    return _FrozenLinear.apply(x, weight)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.frozen_weight = weight
        return torch.nn.functional.linear(x, base_rows(weight, 0, weight.shape[0]).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.frozen_weight
        return grad @ base_rows(weight, 0, weight.shape[0]).to(grad.dtype), None
