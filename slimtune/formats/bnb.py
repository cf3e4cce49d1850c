"""bitsandbytes 4-bit (NF4) weights as Hugging Face "load_in_4bit" checkpoints store them, dequantized
by row range. Layout for a module P: ``P.weight`` (u8 [(n+1)//2, 1], two codes a byte, first in the
high nibble), ``P.weight.absmax`` (per 64-block scale; u8 when double-quantized, with
``nested_absmax`` f32, ``nested_quant_map`` f32[256] and ``nested_offset``), ``P.weight.quant_map``
(f32[16]) and ``P.weight.quant_state.bitsandbytes__nf4`` (u8 bytes of a JSON with quant_type,
blocksize, dtype, shape, nested_blocksize, nested_offset). Math as bitsandbytes: fp32, then cast."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimtune.errors import SlimtuneError

QUANT_STATE_SUFFIX = ".quant_state.bitsandbytes__nf4"
AUX_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", QUANT_STATE_SUFFIX)


def is_aux_key(key: str) -> bool:
    return key.endswith(AUX_SUFFIXES)


@dataclass
class BnbNF4Weight:
    """One 4-bit weight: its small state held in memory, its packed codes read by row range."""

    key: str
    shape: tuple[int, int]
    dtype: torch.dtype
    blocksize: int
    absmax: torch.Tensor  # fp32, one per block, nested quantization already undone
    quant_map: torch.Tensor  # fp32[16]
    read_bytes: Callable[[int, int], torch.Tensor]  # packed byte range [b0, b1) of the u8 weight

    def rows(self, start: int, end: int) -> torch.Tensor:
        cols = self.shape[1]
        e0, e1 = start * cols, end * cols
        packed = self.read_bytes(e0 // 2, (e1 + 1) // 2)
        codes = torch.empty(packed.numel() * 2, dtype=torch.int32)
        codes[0::2] = packed >> 4
        codes[1::2] = packed & 0xF
        first = e0 - (e0 // 2) * 2
        values = self.quant_map[codes[first : first + e1 - e0]]
        scale = self.absmax[torch.arange(e0, e1) // self.blocksize]
        return (values * scale).to(self.dtype).view(end - start, cols)


def load_bnb_weight(key: str, read_small: Callable[[str], torch.Tensor], read_bytes: Callable[[int, int], torch.Tensor], where: str):
    """Build the row reader for ``key`` (a ``P.weight``) from its auxiliary tensors."""
    try:
        state = json.loads(bytes(read_small(key + QUANT_STATE_SUFFIX).tolist()).decode())
        quant_type, blocksize = state["quant_type"], int(state["blocksize"])
        shape = tuple(int(d) for d in state["shape"])
        dtype = getattr(torch, state.get("dtype", "bfloat16"))
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise SlimtuneError(f"{where}: tensor {key}{QUANT_STATE_SUFFIX}: unreadable bitsandbytes quant state ({e!r})") from None
    if quant_type != "nf4":
        raise SlimtuneError(f"{where}: tensor {key}: bitsandbytes quant_type {quant_type!r}, only 'nf4' is supported")
    if len(shape) != 2:
        raise SlimtuneError(f"{where}: tensor {key}: 4-bit weight of shape {list(shape)}, expected 2-D")
    absmax = read_small(key + ".absmax")
    if absmax.dtype == torch.uint8:
        nested_map = read_small(key + ".nested_absmax").float(), read_small(key + ".nested_quant_map").float()
        nested_absmax, nested_code = nested_map
        nested_blocksize = int(state.get("nested_blocksize", 256))
        offset = float(state.get("nested_offset", 0.0))
        idx = torch.arange(absmax.numel()) // nested_blocksize
        absmax = nested_code[absmax.long()] * nested_absmax[idx] + offset
    absmax = absmax.float()
    n_blocks = -(-shape[0] * shape[1] // blocksize)
    if absmax.numel() != n_blocks:
        raise SlimtuneError(f"{where}: tensor {key}.absmax has {absmax.numel()} entries, shape {list(shape)} needs {n_blocks}")
    return BnbNF4Weight(key, shape, dtype, blocksize, absmax, read_small(key + ".quant_map").float(), read_bytes)
