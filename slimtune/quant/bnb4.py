"""A bitsandbytes 4-bit weight (NF4 or FP4, as a ``load_in_4bit`` checkpoint stores it) as slimtune's frozen
base weight, beside torchao's NF4Tensor: the packed codes and the block state held as the file has them,
rows dequantized on demand exactly as ``bitsandbytes.functional.dequantize_4bit`` does
(``formats.bnb.BnbNF4Weight.rows``). It is a tensor of the weight's shape and dtype to everything that holds
parameters (``nn.Parameter``, ``named_parameters``, ``requires_grad_``, a device move, FSDP2's ignored
parameters), and only ``quant.base_rows`` reads its values: the forward (``quant.frozen_linear``), the
merged save's stream and the writers all read rows through it. Any other tensor operation is refused in
one line rather than computed on a 16-bit copy.

Why not torchao's NF4Tensor: bitsandbytes' scales (fp32 absmax, or u8 codes with a nested fp32 absmax and an
offset) are not torchao's (int8 scalers per scaler block with a per-group factor and one mean), so a
conversion would change the weights (bench/bnb_layout.py measures it)."""

from __future__ import annotations

import torch

from slimtune.formats.bnb import BnbNF4Weight

__all__ = ["Bnb4bitTensor", "is_bnb4"]

_aten = torch.ops.aten
_ALIASES = (_aten.detach.default, _aten.alias.default)


class Bnb4bitTensor(torch.Tensor):
    """A frozen bitsandbytes 4-bit weight: ``packed`` (u8, two codes a byte, the file's bytes) and ``state``
    (the weight's block state, ``BnbNF4Weight``). ``rows(s, e)``: rows [s, e) in the weight's dtype.

    Example: ``w = Bnb4bitTensor(state, packed); w.rows(0, w.shape[0])  # == dequantize_4bit(...)``"""

    state: BnbNF4Weight
    packed: torch.Tensor

    @staticmethod
    def __new__(cls, state: BnbNF4Weight, packed: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, state.shape, dtype=state.dtype, device=packed.device, requires_grad=False)

    def __init__(self, state: BnbNF4Weight, packed: torch.Tensor):
        self.packed = packed
        self.state = state.to(packed.device, self._read)

    def _read(self, b0: int, b1: int) -> torch.Tensor:
        return self.packed[b0:b1]

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.state.rows(start, end)

    def nbytes_held(self) -> int:
        return self.state.nbytes()

    def __repr__(self) -> str:
        q = "double-quantized " if self.state.nested else ""
        return f"Bnb4bitTensor({list(self.shape)}, {str(self.dtype).removeprefix('torch.')}, {q}blocks of {self.state.blocksize})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func in _ALIASES:
            return Bnb4bitTensor(w.state, w.packed)
        if func is _aten._to_copy.default and kwargs.get("dtype") in (None, w.dtype) and len(args) == 1:
            device = kwargs.get("device") or w.device
            return Bnb4bitTensor(w.state, w.packed.to(device))
        if func is _aten.is_same_size.default:
            return tuple(args[0].shape) == tuple(args[1].shape)
        raise NotImplementedError(
            f"a bitsandbytes 4-bit frozen weight {list(w.shape)} supports only reading rows (quant.base_rows), not {func}"
        )


def is_bnb4(t: object) -> bool:
    """True for a frozen bitsandbytes 4-bit weight (or a Parameter holding one)."""
    return isinstance(t, Bnb4bitTensor)
