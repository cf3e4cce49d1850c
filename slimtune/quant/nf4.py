"""torchao NF4 in one place: the import (its path moved between releases), quantization, and a chunked
dequantization that is bit-identical to ``NF4Tensor.get_original_weight`` but works on any row range."""

from __future__ import annotations

import math
import sys
import weakref

import torch

from slimtune.quant.nf4_kernel import dequantize_bf16

# torchao logs a warning for each optional CUDA extension it cannot load (none matter for NF4): the
# applications (slimtune's CLI, the benchmarks, the test session) quiet it: ``cli.quiet_library_logs``.
try:  # torchao >= 0.15
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        SubclassTensorArgs,
        to_nf4,
    )
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4 as _torchao_linear_nf4
except ImportError:  # older torchao
    from torchao.dtypes.nf4tensor import NF4Tensor, SubclassTensorArgs, to_nf4  # type: ignore
    from torchao.dtypes.nf4tensor import linear_nf4 as _torchao_linear_nf4  # type: ignore

__all__ = [
    "BLOCK_SIZE",
    "SCALER_BLOCK_SIZE",
    "NF4Tensor",
    "quantize_nf4",
    "can_quantize",
    "scaler_block_size",
    "dequantize_nf4_rows",
    "nf4_from_parts",
    "nf4_linear",
]

BLOCK_SIZE = 64
_LITTLE_ENDIAN = sys.byteorder == "little"
SCALER_BLOCK_SIZE = 256  # torchao's default, and the largest slimtune uses


def scaler_block_size(shape: torch.Size | tuple[int, ...]) -> int | None:
    """The scaler block (64-element blocks per double-quantization group) of an NF4 weight of ``shape``:
    the largest divisor of its number of 64-element blocks that is at most 256 (torchao's default when
    it divides, as for widths that are multiples of 128; 216 for a 576 x 576 projection), or None when
    the weight cannot be NF4 at all (not 2-D, empty, or not whole 64-element blocks).

    Example: ``scaler_block_size((576, 576)) == 216``"""
    if len(shape) != 2:
        return None
    numel = shape[0] * shape[1]
    if numel == 0 or numel % BLOCK_SIZE:
        return None
    blocks = numel // BLOCK_SIZE
    return next(d for d in range(min(SCALER_BLOCK_SIZE, blocks), 0, -1) if blocks % d == 0)


def can_quantize(shape: torch.Size | tuple[int, ...]) -> bool:
    """NF4 needs a 2-D weight made of whole 64-element blocks (its scaler block is then chosen to fit)."""
    return scaler_block_size(shape) is not None


def not_quantizable_reason(shape: torch.Size | tuple[int, ...]) -> str:
    """Why a weight of ``shape`` cannot be NF4 (for messages), or "" when it can."""
    if len(shape) != 2:
        return f"{len(shape)}-D, not 2-D"
    numel = shape[0] * shape[1]
    if numel == 0:
        return "empty"
    return "" if numel % BLOCK_SIZE == 0 else f"{numel} elements, not whole {BLOCK_SIZE}-element blocks"


QUANTIZE_PIECE = 2**19  # elements per piece of quantize_nf4: its temporaries are a few MB, whatever the weight


def quantize_nf4(weight: torch.Tensor, piece: int = QUANTIZE_PIECE) -> NF4Tensor:
    """torchao's to_nf4 with 64-element blocks and the scaler block ``scaler_block_size`` picks for the
    shape, bit for bit, worked ``piece`` elements at a time into the packed output: torchao's makes
    several whole-weight temporaries (|W|, W / absmax, one code byte per element, the two halves of the
    packing: ~2.5x the bf16 weight for a 14336 x 4096 projection), and freed between kept tensors of
    similar size they fragment the heap (glibc kept ~60 MB per Llama-3-8B layer, ~1.7 GB over the
    model, resident after the load). Here the temporaries are a few MB, reused piece after piece.

    Example: ``w4 = quantize_nf4(torch.randn(128, 64, dtype=torch.bfloat16))``"""
    sbs = scaler_block_size(tuple(weight.shape))
    if sbs is None:
        raise ValueError(f"a {list(weight.shape)} weight cannot be NF4 ({not_quantizable_reason(tuple(weight.shape))})")
    weight = weight.contiguous()
    flat = weight.view(-1)
    numel, step = flat.numel(), max(BLOCK_SIZE, piece // BLOCK_SIZE * BLOCK_SIZE)
    absmax = torch.empty(numel // BLOCK_SIZE, dtype=weight.dtype, device=weight.device)
    for s in range(0, numel, step):  # torchao's get_block_absmax, by piece
        absmax[s // BLOCK_SIZE : (s + step) // BLOCK_SIZE] = flat[s : s + step].view(-1, BLOCK_SIZE).abs().amax(dim=1)
    quantized_scalers, factor, mean = _double_quantize(absmax, sbs)
    nf4 = _nf4_codes(weight.dtype).to(weight.device)
    data = torch.empty(numel // 2, dtype=torch.uint8, device=weight.device)
    for s in range(0, numel, step):  # torchao's convert_to_norm_float_weight, by piece
        blocks = flat[s : s + step].view(-1, BLOCK_SIZE)
        scaled = (blocks / absmax[s // BLOCK_SIZE : s // BLOCK_SIZE + blocks.shape[0]].unsqueeze(-1)).view(-1, 1)
        codes = (scaled - nf4).abs_().argmin(dim=-1).to(torch.uint8)  # quantize_tensor_nearest: the first nearest code
        pairs = codes.view(torch.int16) if _LITTLE_ENDIAN else codes.view(-1, 2).flip(1).contiguous().view(torch.int16)
        data[s // 2 : s // 2 + pairs.numel()] = ((pairs << 4) | (pairs >> 8)).to(torch.uint8)  # [a, b] -> a << 4 | b (cast: low byte)
    meta = SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), weight.dtype, weight.device, weight.requires_grad)
    return NF4Tensor(meta, BLOCK_SIZE, numel // BLOCK_SIZE, sbs, quantized_scalers, factor, mean, data, nf4)


def _double_quantize(block_absmax: torch.Tensor, sbs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's double_quantize_scalers on the per-block absmax vector (what it computes from the
    weight): the int8 block scalers, the per-scaler-block factors and the mean, the same operations."""
    mean = block_absmax.mean()
    scaler_blocks = (block_absmax - mean).view(-1, sbs)
    factor = 256 / (2 * scaler_blocks.abs().max(dim=1).values)
    quantized = (scaler_blocks * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    return quantized, factor.contiguous(), mean


def _byte_pair_table(w: NF4Tensor) -> torch.Tensor:
    """int32[256]: entry b packs the two code values (nf4[b >> 4], nf4[b & 15]) of byte b, so one
    1-D gather per byte replaces two int64 gathers per element (only bits move: nothing is rounded)."""
    table = _PAIR_TABLES.get(id(w))
    if table is None or table.device != w.quantized_data.device:
        codes = torch.arange(256, device=w.nf4.device)
        pairs = torch.stack([w.nf4[codes >> 4], w.nf4[codes & 15]], dim=1).contiguous()
        table = pairs.view(torch.int32).view(256) if pairs.element_size() == 2 else pairs
        if id(w) not in _PAIR_TABLES:
            weakref.finalize(w, _PAIR_TABLES.pop, id(w), None)  # the entry goes with the weight
        _PAIR_TABLES[id(w)] = table
    return table


_PAIR_TABLES: dict[int, torch.Tensor] = {}  # id(weight) -> its table: kept beside torchao's tensor, not on it


def _quad_table(w: NF4Tensor) -> torch.Tensor:
    """int64[65536] for a 16-bit weight: entry v packs the four code values of the little-endian 16-bit
    word v (byte v & 255 first, each byte as ``_byte_pair_table`` unpacks it), so one gather per two bytes
    replaces two. One table per code book, dtype and device, shared by every weight of it (512 KB);
    only bits move."""
    pairs = _byte_pair_table(w)
    key = (w.dtype, pairs.device, tuple(w.nf4.view(torch.int16).tolist()))
    table = _QUAD_TABLES.get(key)
    if table is None:
        values = pairs.view(w.dtype).view(256, 2)
        v = torch.arange(65536, device=pairs.device)
        table = torch.cat([values[v & 255], values[v >> 8]], dim=1).contiguous().view(torch.int64).view(65536)
        _QUAD_TABLES[key] = table
    return table


_QUAD_TABLES: dict[tuple, torch.Tensor] = {}  # (dtype, device, code book) -> quad table: one or two in a run
_LITTLE_ENDIAN = sys.byteorder == "little"
DEQUANT_PIECE = 1 << 18
"""Values a 16-bit weight is dequantized in at a time (``dequantize_nf4_rows``): the piece's index (256 KB),
gathered values and their scaling stay in the core's cache instead of three passes over the whole weight in
memory (SmolLM2's small weights are one piece)."""


def _scalers(w: NF4Tensor, b0: int, b1: int) -> torch.Tensor:
    """The dequantized block scales of blocks [b0, b1) in the weight's dtype, as torchao makes them
    (q / factor + mean; its [n, sbs] / factor[:, None] on the scaler blocks that cover them)."""
    sbs = w.scaler_block_size
    s0, s1 = b0 // sbs, -(-b1 // sbs)
    scalers = (w.quantized_scalers[s0 * sbs : s1 * sbs].view(s1 - s0, sbs) / w.quantization_factor[s0:s1].unsqueeze(-1)).view(-1)
    return scalers[b0 - s0 * sbs : b1 - s0 * sbs].to(w.dtype) + w.scaler_mean


def dequantize_nf4_rows(w: NF4Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of the weight in its dtype, with the same operations, in the same dtype and order
    as torchao (scale = q / factor + mean, w = nf4[code] * scale), so the bits are identical. bf16 weights
    on the CPU go through the C loop where it is built (``quant.nf4_kernel``: each block's 16 values made
    once, the codes looked up in a register); otherwise 16-bit weights look their codes up two bytes (four
    values) at a time (``_quad_table``) into the output, a ``DEQUANT_PIECE`` of values at a time, scaled
    in place, and other dtypes a byte at a time, whole.

    Example: ``dequantize_nf4_rows(quantize_nf4(w), 0, 4)  # == the NF4 weight's first 4 rows, torchao's bits``"""
    cols, bs = w.shape[1], w.block_size
    e0, e1 = start * cols, end * cols
    b0, b1 = e0 // bs, -(-e1 // bs)
    values = None if torch.compiler.is_compiling() else dequantize_bf16(w, b0, b1)
    if values is not None:
        return values[e0 - b0 * bs : e1 - b0 * bs].view(end - start, cols)
    packed = w.quantized_data[b0 * bs // 2 : b1 * bs // 2]  # bs // 2 bytes per block
    scalers = _scalers(w, b0, b1)
    if w.nf4.element_size() == 2 and _LITTLE_ENDIAN and bs % 4 == 0:
        out = torch.empty((b1 - b0) * bs, dtype=w.dtype, device=packed.device)
        words, quads, table = packed.view(torch.uint16), out.view(torch.int64), _quad_table(w)
        step = max(bs, DEQUANT_PIECE - DEQUANT_PIECE % bs) // 4  # words per piece: whole blocks
        index = torch.empty(min(step, words.numel()), dtype=torch.int32, device=packed.device)
        for q0 in range(0, words.numel(), step):
            q1 = min(q0 + step, words.numel())
            piece = index[: q1 - q0].copy_(words[q0:q1])  # the little-endian 16-bit words as indices
            torch.index_select(table, 0, piece, out=quads[q0:q1])
            out[4 * q0 : 4 * q1].view(-1, bs).mul_(scalers[4 * q0 // bs : 4 * q1 // bs].unsqueeze(-1))
        values = out
    else:
        table = _byte_pair_table(w)
        gathered = table.index_select(0, packed.to(torch.int32))
        values = (gathered.view(w.dtype) if table.dim() == 1 else gathered.view(-1)).view(b1 - b0, bs) * scalers.unsqueeze(-1)
    return values.view(-1)[e0 - b0 * bs : e1 - b0 * bs].view(end - start, cols)


def nf4_linear(x: torch.Tensor, weight: NF4Tensor) -> torch.Tensor:
    """x @ W^T for an NF4 weight, differentiable in x, saving the NF4 weight (not a dequantized copy) for
    the backward pass: torchao's ``linear_nf4`` with the same math (dequantize, cast to x's dtype, one
    matmul each way) and ``dequantize_nf4_rows``'s lookup (the C loop for bf16, else a table gather
    instead of torchao's two int64 gathers per element, a stack and a concatenation), bit-identical:
    several times faster on the CPU (``python -m bench nf4``). Under torch.compile (which fuses torchao's) and off the CPU
    (slimtune's lookup is not yet measured against torchao's on a GPU) torchao's own is used.

    Example: ``y = nf4_linear(x, quantize_nf4(w))``"""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return _torchao_linear_nf4(x, weight)
    return _NF4Linear.apply(x, weight)


class _NF4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Tensor) -> torch.Tensor:
        ctx.nf4_weight = weight
        return torch.nn.functional.linear(x, dequantize_nf4_rows(weight, 0, weight.shape[0]).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.nf4_weight
        return grad @ dequantize_nf4_rows(weight, 0, weight.shape[0]).to(grad.dtype), None


def nf4_from_parts(
    shape: tuple[int, int],
    dtype: torch.dtype,
    quantized_data: torch.Tensor,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
) -> NF4Tensor:
    """Build an NF4Tensor from its inner tensors (synthetic benchmarks, reloading saved NF4 state); the
    scaler block is the one ``scaler_block_size`` picks for the shape, as ``quantize_nf4`` uses."""
    nf4 = _nf4_codes(dtype)
    numel = shape[0] * shape[1]
    meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, quantized_data.device, False)
    return NF4Tensor(
        meta,
        BLOCK_SIZE,
        numel // BLOCK_SIZE,
        scaler_block_size(shape),
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        nf4.to(quantized_data.device),
    )


def _nf4_codes(dtype: torch.dtype) -> torch.Tensor:
    """torchao's 16 NF4 code values in ``dtype`` (its lookup table, taken from a quantized zero block)."""
    return to_nf4(torch.zeros(1, BLOCK_SIZE * SCALER_BLOCK_SIZE, dtype=dtype), BLOCK_SIZE, SCALER_BLOCK_SIZE).nf4


class NF4RoundTrip:
    """dequant(to_nf4(W)) by row range, for a W read by rows (the weights a QLoRA adapter was trained
    against), bit-identical to torchao's, without holding W: a first pass collects the per-block absmax
    (numel/64 values), which fixes the double-quantized scalers; then each row range is quantized to
    the nearest NF4 code and dequantized with those scalers, the same elementwise operations as torchao."""

    def __init__(self, read_rows, shape: tuple[int, int], dtype: torch.dtype, chunk_rows: int):
        self.read_rows, self.shape, self.dtype = read_rows, shape, dtype
        sbs = scaler_block_size(shape)
        if sbs is None:
            raise ValueError(f"a {list(shape)} weight cannot be NF4 ({not_quantizable_reason(shape)})")
        rows, cols = shape
        align = BLOCK_SIZE // math.gcd(cols, BLOCK_SIZE)  # rows per whole number of 64-blocks
        step = -(-max(1, chunk_rows) // align) * align
        absmax = [read_rows(s, min(s + step, rows)).reshape(-1, BLOCK_SIZE).abs().max(dim=1).values for s in range(0, rows, step)]
        block_absmax = torch.cat(absmax)
        quantized, factor, mean = _double_quantize(block_absmax, sbs)
        # torchao's dequantize_scalers
        self.scalers = (quantized.view(-1, sbs) / factor.unsqueeze(-1)).flatten().to(dtype) + mean
        self.block_absmax = block_absmax
        self.scaler_block_size = sbs
        self.nf4 = _nf4_codes(dtype)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of dequant(NF4(W)); rows that start or end inside a 64-block (widths that
        are not multiples of 64) read the neighbouring rows that complete the block."""
        rows, cols = self.shape
        e0, e1 = start * cols, end * cols
        b0, b1 = e0 // BLOCK_SIZE, -(-e1 // BLOCK_SIZE)
        r0, r1 = b0 * BLOCK_SIZE // cols, min(rows, -(-b1 * BLOCK_SIZE // cols))
        flat = self.read_rows(r0, r1).reshape(-1)[b0 * BLOCK_SIZE - r0 * cols : b1 * BLOCK_SIZE - r0 * cols]
        blocks = flat.reshape(-1, BLOCK_SIZE)
        scaled = (blocks / self.block_absmax[b0:b1].unsqueeze(-1)).flatten()
        codes = torch.empty(scaled.numel(), dtype=torch.long)
        for i in range(0, scaled.numel(), 2**20):  # torchao's chunking: bounds the [n, 16] distance table
            codes[i : i + 2**20] = (scaled[i : i + 2**20].unsqueeze(-1) - self.nf4).abs().min(dim=-1).indices
        values = self.nf4[codes].view(-1, BLOCK_SIZE) * self.scalers[b0:b1].unsqueeze(-1)
        return values.view(-1)[e0 - b0 * BLOCK_SIZE : e1 - b0 * BLOCK_SIZE].view(end - start, cols)


def nf4_nbytes(w: torch.Tensor) -> int:
    """Bytes an NF4 weight holds: its 4-bit codes, its 8-bit block scalers and their per-group factors."""
    return sum(t.numel() * t.element_size() for t in (w.quantized_data, w.quantized_scalers, w.quantization_factor))
