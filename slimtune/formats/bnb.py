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
from slimtune.formats.safetensors import SafetensorsReader
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
    """One 4-bit weight: its small state held in memory as stored (a double-quantized absmax stays u8 codes,
    undone per row range), its packed codes read by row range."""

    key: str
    shape: tuple[int, int]
    dtype: torch.dtype
    blocksize: int
    absmax: torch.Tensor  # one per block: fp32, or the u8 codes of the nested quantization (``nested``)
    quant_map: torch.Tensor  # fp32[16]
    read_bytes: Callable[[int, int], torch.Tensor]  # packed byte range [b0, b1) of the u8 weight
    nested: tuple[torch.Tensor, torch.Tensor, int, float] | None = None  # fp32 code[256], fp32 nested absmax, nested blocksize, offset

    def scales(self, b0: int, b1: int) -> torch.Tensor:
        """The fp32 absmax of blocks [b0, b1), the nested quantization undone as bitsandbytes undoes it
        (code[a] * nested_absmax[group] in fp32, then + offset): over the whole nested groups that cover
        the blocks, one group per row, so no per-block group index is built."""
        if self.nested is None:
            return self.absmax[b0:b1]
        code, nested_absmax, nested_blocksize, offset = self.nested
        g0, g1 = b0 // nested_blocksize, -(-b1 // nested_blocksize)
        lo, hi = g0 * nested_blocksize, min(g1 * nested_blocksize, self.absmax.numel())
        values = code.index_select(0, self.absmax[lo:hi].to(torch.int32))
        whole = (hi - lo) // nested_blocksize  # the last group of the weight may be short
        values[: whole * nested_blocksize].view(whole, nested_blocksize).mul_(nested_absmax[g0 : g0 + whole].unsqueeze(-1))
        if whole < g1 - g0:
            values[whole * nested_blocksize :].mul_(nested_absmax[g0 + whole])
        return values.add_(offset)[b0 - lo : b1 - lo]

    def nbytes(self) -> int:
        """Bytes of the packed codes and the block state (what a frozen 4-bit weight holds)."""
        state = [self.absmax, self.quant_map, *(self.nested[:2] if self.nested else ())]
        return (self.shape[0] * self.shape[1] + 1) // 2 + sum(t.numel() * t.element_size() for t in state)

    def to(self, device: torch.device, read_bytes: Callable[[int, int], torch.Tensor]) -> BnbNF4Weight:
        """The same weight with its state on ``device``, its bytes from ``read_bytes``."""
        nested = None if self.nested is None else (self.nested[0].to(device), self.nested[1].to(device), *self.nested[2:])
        return BnbNF4Weight(
            self.key, self.shape, self.dtype, self.blocksize, self.absmax.to(device), self.quant_map.to(device), read_bytes, nested
        )

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as ``bitsandbytes.functional.dequantize_4bit`` makes them: code value * block
        absmax in fp32, cast to the weight's dtype (bit for bit: only the gathers differ)."""
        cols, bs = self.shape[1], self.blocksize
        e0, e1 = start * cols, end * cols
        if bs % 2:
            return self._rows_by_element(e0, e1).view(end - start, cols)
        b0, b1 = e0 // bs, -(-e1 // bs)
        f0, f1 = b0 * bs, min(b1 * bs, self.shape[0] * cols)  # whole blocks (the last may be short)
        packed = self.read_bytes(f0 // 2, (f1 + 1) // 2)
        values = _pair_table(self.quant_map).index_select(0, packed.to(torch.int32)).view(torch.float32)[: f1 - f0]
        scales = self.scales(b0, b1)
        whole = (f1 - f0) // bs  # the weight's last block may be short
        values[: whole * bs].view(whole, bs).mul_(scales[:whole].unsqueeze(-1))
        if whole < b1 - b0:
            values[whole * bs :].mul_(scales[whole])
        return values[e0 - f0 : e1 - f0].to(self.dtype).view(end - start, cols)

    def _rows_by_element(self, e0: int, e1: int) -> torch.Tensor:
        packed = self.read_bytes(e0 // 2, (e1 + 1) // 2)
        codes = torch.empty(packed.numel() * 2, dtype=torch.int32, device=packed.device)
        codes[0::2] = packed >> 4
        codes[1::2] = packed & 0xF
        first = e0 - (e0 // 2) * 2
        values = self.quant_map[codes[first : first + e1 - e0]]
        b0, b1 = e0 // self.blocksize, -(-e1 // self.blocksize)
        blocks = torch.arange(e0, e1, device=packed.device) // self.blocksize - b0
        return (values * self.scales(b0, b1)[blocks]).to(self.dtype)


def _pair_table(quant_map: torch.Tensor) -> torch.Tensor:
    """int64[256]: entry b holds the two fp32 code values (high nibble first) of byte b, so one 1-D gather
    per byte replaces two per element (only bits move: nothing is rounded; view the result as fp32)."""
    codes = torch.arange(256, device=quant_map.device)
    return torch.stack([quant_map[codes >> 4], quant_map[codes & 15]], dim=1).contiguous().view(torch.int64).view(256)


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


_STORAGE_DTYPES = ("uint8", "int8", "bfloat16", "float16", "float32")


def bnb_4bit_settings(config: dict, where: str) -> str | None:
    """For a training base: None for a plain (16-bit) config.json; for a bitsandbytes 4-bit one its
    ``quantization_config`` checked (quant type nf4 or fp4, compute and storage dtype names, the skipped
    modules a list of names) and described in a few words for the log. 8-bit bitsandbytes and other
    quantization methods are refused in one line.

    Example: ``bnb_4bit_settings(read_config_dict(d), str(d / "config.json"))`` -> ``"nf4, double quant, ..."``"""
    q = config.get("quantization_config")
    if q is None:
        return None
    label = f"{where}: quantization_config"
    if not isinstance(q, dict):
        raise SlimtuneError(f"{label} must be an object, found {json_kind(q)}")
    method = q.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        shown = safe_name(method)[:40] if isinstance(method, str) else json_kind(method)
        raise SlimtuneError(f"{label}.quant_method {shown}: slimtune trains from 16-bit bases and bitsandbytes 4-bit ones only")
    refuse_8bit(config, where)
    if bnb_quantization(config) != "4bit":
        raise SlimtuneError(f"{label}: bitsandbytes without load_in_4bit (nor load_in_8bit) true: not a checkpoint slimtune reads")
    quant_type = q.get("bnb_4bit_quant_type", "fp4")
    if not isinstance(quant_type, str) or quant_type not in QUANT_STATE_SUFFIXES:
        shown = safe_name(repr(quant_type))[:40] if isinstance(quant_type, str) else json_kind(quant_type)
        raise SlimtuneError(f"{label}.bnb_4bit_quant_type {shown}: expected 'nf4' or 'fp4'")
    for key, names in (("bnb_4bit_compute_dtype", tuple(_FLOAT_DTYPES)), ("bnb_4bit_quant_storage", _STORAGE_DTYPES)):
        value = q.get(key)
        if value is not None and value not in names:
            shown = safe_name(repr(value))[:40] if isinstance(value, str) else json_kind(value)
            raise SlimtuneError(f"{label}.{key} {shown}: expected one of {list(names)}")
    skip = q.get("llm_int8_skip_modules")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise SlimtuneError(f"{label}.llm_int8_skip_modules must be a list of module names, found {json_kind(skip)}")
    double = "double quant" if q.get("bnb_4bit_use_double_quant") is True else "no double quant"
    compute, storage = q.get("bnb_4bit_compute_dtype") or "float32", q.get("bnb_4bit_quant_storage") or "uint8"
    return f"{quant_type}, {double}, compute dtype {compute}, storage {storage}"


def four_bit_keys(names) -> set[str]:
    """The 4-bit weights among a checkpoint's tensor names: each ``P.weight`` with a ``P.weight.absmax``."""
    names = set(names)
    return {k for k in names if k.endswith(".weight") and k + ".absmax" in names}


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
    nested = None
    if absmax.dtype == torch.uint8:
        nested = _nested_state(key, state, read_small, n_blocks, label, where)
    elif absmax.dtype not in _FLOAT_DTYPES.values():
        raise SlimtuneError(f"{where}: tensor {safe_name(key)}.absmax is {absmax.dtype}, expected a float or u8 (nested) tensor")
    else:
        absmax = absmax.float()
    quant_map = read_small(key + ".quant_map")
    if quant_map.numel() != 16 or quant_map.dtype not in _FLOAT_DTYPES.values() or not bool(torch.isfinite(quant_map).all()):
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}.quant_map must be 16 finite floats, found {quant_map.dtype} {list(quant_map.shape)}"
        )
    weight = BnbNF4Weight(key, shape, dtype, blocksize, absmax, quant_map.float().reshape(16), read_bytes, nested)
    # every scale as the rows will compute it, a piece of blocks at a time: the load's only temporaries here stay
    # small (a whole weight's fp32 scales and indexes would be freed between held tensors and fragment the heap)
    for b in range(0, n_blocks, _CHECK_BLOCKS):
        if not bool(torch.isfinite(weight.scales(b, min(b + _CHECK_BLOCKS, n_blocks))).all()):
            raise SlimtuneError(f"{where}: tensor {safe_name(key)}.absmax holds NaN or infinite scales")
    return weight


_CHECK_BLOCKS = 1 << 14  # blocks of scales checked at a time: 64 KB of fp32


def _nested_state(key: str, state: dict, read_small, n_blocks: int, label: str, where: str) -> tuple:
    """A double-quantized absmax's state, checked: (fp32 code[256], fp32 nested absmax, nested blocksize, offset)."""
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
    groups = -(-n_blocks // nested_blocksize)
    if nested_absmax.dim() != 1 or nested_absmax.numel() != groups or nested_absmax.dtype not in _FLOAT_DTYPES.values():
        raise SlimtuneError(
            f"{where}: tensor {safe_name(key)}.nested_absmax has {nested_absmax.dtype} {list(nested_absmax.shape)}, "
            f"expected {groups} floats"
        )
    return nested_code.float().reshape(256), nested_absmax.float(), nested_blocksize, offset


def packed_byte_reader(reader: SafetensorsReader, key: str) -> Callable[[int, int], torch.Tensor]:
    """Bytes [b0, b1) of a packed 4-bit weight, held in a [k, 1] tensor of any bnb_4bit_quant_storage dtype
    (u8, bf16, ...): the rows that hold those bytes are read and viewed as bytes."""
    entry = reader.entry(key)
    width = entry.nbytes // entry.shape[0] if len(entry.shape) == 2 and entry.shape[0] else 0
    if len(entry.shape) != 2 or entry.shape[1] != 1 or entry.dtype is None or width != entry.dtype.itemsize:
        found = f"{entry.dtype_name} {list(entry.shape)}"
        raise SlimtuneError(f"{reader.path}: tensor {safe_name(key)}: packed 4-bit weight of {found}, expected [n, 1]")

    def read(b0: int, b1: int) -> torch.Tensor:
        r0, r1 = b0 // width, -(-b1 // width)
        return reader.read(key, r0, r1).contiguous().view(torch.uint8).view(-1)[b0 - r0 * width : b1 - r0 * width]

    return read


def read_4bit_weights(location: dict[str, SafetensorsReader], where: str) -> dict[str, BnbNF4Weight]:
    """Every bitsandbytes 4-bit weight of a checkpoint (``location``: tensor name -> the shard holding it;
    a weight's auxiliary tensors may sit in another shard), its state checked and held, its packed bytes
    read from the file by range. A ``P.weight`` with a ``P.weight.absmax`` is 4-bit.

    Example: ``weights = read_4bit_weights({k: r for r in readers for k in r.tensors}, str(model_dir))``"""

    def read_small(name: str) -> torch.Tensor:
        if name not in location:
            raise SlimtuneError(f"{where}: bitsandbytes tensor {safe_name(name)} is missing")
        return location[name].read(name)

    weights = {}
    for key in sorted(four_bit_keys(location)):
        reader = location[key]
        state = quant_state_key(key, location) or key + QUANT_STATE_SUFFIX  # missing: named as NF4's
        packed = reader.entry(key).nbytes
        weights[key] = load_bnb_weight(key, read_small, packed_byte_reader(reader, key), str(reader.path), packed, state)
    return weights
