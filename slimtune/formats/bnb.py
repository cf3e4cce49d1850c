"""bitsandbytes 4-bit (NF4 and FP4) weights as Hugging Face "load_in_4bit" checkpoints store them, dequantized
by row range. Layout for a module P: ``P.weight`` (the packed bytes, two codes a byte, first in the high
nibble, held in a [k, 1] tensor of the ``bnb_4bit_quant_storage`` dtype: u8 [(n+1)//2, 1], or bf16 [n/4, 1] ...),
``P.weight.absmax`` (per 64-block scale; u8 when double-quantized, with
``nested_absmax`` f32, ``nested_quant_map`` f32[256] and ``nested_offset``), ``P.weight.quant_map``
(f32[16]) and ``P.weight.quant_state.bitsandbytes__nf4`` (``__fp4``; u8 bytes of a JSON with quant_type,
blocksize, dtype, shape, nested_blocksize, nested_offset). Math as bitsandbytes: fp32, then cast."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimtune.errors import SlimtuneError
from slimtune.formats.strict_json import json_kind, loads_json, safe_name

QUANT_STATE_SUFFIX = ".quant_state.bitsandbytes__nf4"
QUANT_STATE_SUFFIXES = {"nf4": QUANT_STATE_SUFFIX, "fp4": ".quant_state.bitsandbytes__fp4"}  # quant_type -> the key's suffix
# Longest first, so ".nested_absmax" is not taken for ".absmax".
AUX_SUFFIXES = (*QUANT_STATE_SUFFIXES.values(), ".nested_quant_map", ".nested_absmax", ".quant_map", ".absmax")
_FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def is_aux_key(key: str) -> bool:
    return key.endswith(AUX_SUFFIXES)


def aux_owner(key: str) -> str:
    """The weight an auxiliary tensor belongs to (``P.weight.absmax`` -> ``P.weight``); other keys unchanged."""
    for suffix in AUX_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


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


def bnb_quantization(config: dict) -> str | None:
    """``"4bit"`` or ``"8bit"`` for a config.json whose ``quantization_config`` is bitsandbytes' (``load_in_4bit`` /
    ``load_in_8bit``), else None."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method", "bitsandbytes") != "bitsandbytes":
        return None
    return "4bit" if q.get("load_in_4bit") is True else "8bit" if q.get("load_in_8bit") is True else None


def refuse_8bit(config: dict, where: str) -> None:
    """One line for an 8-bit bitsandbytes base (LLM.int8 weights with SCB scales): slimtune reads 4-bit only."""
    if bnb_quantization(config) == "8bit":
        raise SlimtuneError(
            f"{where}: a bitsandbytes 8-bit checkpoint (quantization_config.load_in_8bit); slimtune reads 16-bit bases and "
            "bitsandbytes 4-bit ones (load_in_4bit), not 8-bit: use the model's 16-bit checkpoint"
        )


def quant_state_key(key: str, present) -> str | None:
    """The quant state tensor of the 4-bit weight ``key`` among the names ``present`` (NF4's or FP4's), or None."""
    return next((key + s for s in QUANT_STATE_SUFFIXES.values() if key + s in present), None)


def load_bnb_weight(
    key: str,
    read_small: Callable[[str], torch.Tensor],
    read_bytes: Callable[[int, int], torch.Tensor],
    where: str,
    packed_bytes: int | None = None,
    state_key: str | None = None,
):
    """Build the row reader for ``key`` (a ``P.weight``) from its auxiliary tensors, every field of the
    quant state checked (types, ranges, float dtype) and every size against the shape it declares:
    ``packed_bytes`` (the packed weight's length) must be exactly ceil(rows * cols / 2). ``state_key``:
    the quant state's name (``quant_state_key``; default NF4's); its quant_type must be the one it names."""
    state_key = state_key or key + QUANT_STATE_SUFFIX
    label = f"{where}: tensor {safe_name(state_key)}"
    raw = read_small(state_key)
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise SlimtuneError(f"{label}: expected the u8 bytes of a JSON quant state, found {raw.dtype} {list(raw.shape)}")
    state = loads_json(bytes(raw.tolist()), label, expect=dict)
    quant_type, blocksize, shape = state.get("quant_type"), state.get("blocksize"), state.get("shape")
    dtype_name = state.get("dtype", "bfloat16")
    if not isinstance(quant_type, str) or not state_key.endswith(QUANT_STATE_SUFFIXES.get(quant_type, "\0")):
        raise SlimtuneError(
            f"{label}: bitsandbytes quant_type {safe_name(repr(quant_type))[:40]}, expected 'nf4' or 'fp4' "
            f"(the one its name says: {state_key.rpartition('__')[2]!r})"
        )
    if type(blocksize) is not int or not 0 < blocksize <= 1 << 20:
        raise SlimtuneError(f"{label}: blocksize must be a positive integer, found {json_kind(blocksize)} {blocksize!r}"[:300])
    if not isinstance(shape, list) or len(shape) != 2 or not all(type(d) is int and 0 < d < 1 << 40 for d in shape):
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}: 4-bit weight of shape {safe_name(repr(shape))[:80]}, expected 2 positive integers"
        )
    if not isinstance(dtype_name, str) or dtype_name not in _FLOAT_DTYPES:
        raise SlimtuneError(f"{label}: dtype {safe_name(repr(dtype_name))[:40]}, expected one of {sorted(_FLOAT_DTYPES)}")
    shape, dtype = (shape[0], shape[1]), _FLOAT_DTYPES[dtype_name]
    numel = shape[0] * shape[1]
    if packed_bytes is not None and packed_bytes != (numel + 1) // 2:
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}: packed 4-bit weight holds {packed_bytes} bytes, "
            f"shape {list(shape)} needs {(numel + 1) // 2}"
        )
    n_blocks = -(-numel // blocksize)
    absmax = read_small(key + ".absmax")
    if absmax.dim() != 1 or absmax.numel() != n_blocks:
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}.absmax has shape {list(absmax.shape)}, shape {list(shape)} needs [{n_blocks}]"
        )
    if absmax.dtype == torch.uint8:
        nested_absmax, nested_code = read_small(key + ".nested_absmax"), read_small(key + ".nested_quant_map")
        nested_blocksize, offset = state.get("nested_blocksize", 256), state.get("nested_offset", 0.0)
        if type(nested_blocksize) is not int or not 0 < nested_blocksize <= 1 << 20:
            raise SlimtuneError(f"{label}: nested_blocksize must be a positive integer, found {nested_blocksize!r}"[:300])
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
            raise SlimtuneError(f"{label}: nested_offset must be a finite number, found {json_kind(offset)}")
        if nested_code.numel() != 256 or nested_code.dtype not in _FLOAT_DTYPES.values():
            raise SlimtuneError(
                f"{where}: tensor {safe_name(key)}.nested_quant_map must be 256 floats, found {nested_code.dtype} {list(nested_code.shape)}"
            )
        if (
            nested_absmax.dim() != 1
            or nested_absmax.numel() != -(-n_blocks // nested_blocksize)
            or nested_absmax.dtype not in _FLOAT_DTYPES.values()
        ):
            raise SlimtuneError(
                f"{where}: tensor {safe_name(key)}.nested_absmax has {nested_absmax.dtype} {list(nested_absmax.shape)}, "
                f"expected {-(-n_blocks // nested_blocksize)} floats"
            )
        idx = torch.arange(absmax.numel()) // nested_blocksize
        absmax = nested_code.float()[absmax.long()] * nested_absmax.float()[idx] + offset
    elif absmax.dtype not in _FLOAT_DTYPES.values():
        raise SlimtuneError(f"{where}: tensor {safe_name(key)}.absmax is {absmax.dtype}, expected a float or u8 (nested) tensor")
    absmax = absmax.float()
    if not bool(torch.isfinite(absmax).all()):
        raise SlimtuneError(f"{where}: tensor {safe_name(key)}.absmax holds NaN or infinite scales")
    quant_map = read_small(key + ".quant_map")
    if quant_map.numel() != 16 or quant_map.dtype not in _FLOAT_DTYPES.values() or not bool(torch.isfinite(quant_map).all()):
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}.quant_map must be 16 finite floats, found {quant_map.dtype} {list(quant_map.shape)}"
        )
    return BnbNF4Weight(key, shape, dtype, blocksize, absmax, quant_map.float().reshape(16), read_bytes)
