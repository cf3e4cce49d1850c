"""Quantized weights. torchao costs ~80 MB of RSS to import, so paths that never meet an NF4 tensor
(the offline merge of a bf16 base) test for one without importing it."""

from __future__ import annotations

import sys

import torch

from slimtune.profiler import stage

_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")


def is_nf4(t: torch.Tensor) -> bool:
    """True for a torchao NF4Tensor. If torchao's NF4 module was never imported, none can exist."""
    for name in _NF4_MODULES:
        module = sys.modules.get(name)
        if module is not None and isinstance(t, module.NF4Tensor):
            return True
    return False


def base_rows(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows of a frozen base weight in its own dtype: NF4 dequantized exactly as torchao does."""
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
    return weight.numel() * weight.element_size()
