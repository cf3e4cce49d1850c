"""torchao NF4 in one place: the import (its path moved between releases), quantization, and a chunked
dequantization that is bit-identical to ``NF4Tensor.get_original_weight`` but works on any row range."""

from __future__ import annotations

import weakref

import torch

# torchao logs a warning for each optional CUDA extension it cannot load (none matter for NF4): the
# applications (slimtune's CLI, the benchmarks, the test session) quiet it: ``cli.quiet_library_logs``.
try:  # torchao >= 0.15
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        SubclassTensorArgs,
        linear_nf4,
        to_nf4,
    )
except ImportError:  # older torchao
    from torchao.dtypes.nf4tensor import NF4Tensor, SubclassTensorArgs, linear_nf4, to_nf4  # type: ignore

__all__ = [
    "BLOCK_SIZE",
    "SCALER_BLOCK_SIZE",
    "NF4Tensor",
    "linear_nf4",
    "quantize_nf4",
    "can_quantize",
    "dequantize_nf4_rows",
    "nf4_from_parts",
]

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256


def can_quantize(shape: torch.Size | tuple[int, ...]) -> bool:
    """NF4 needs a 2-D weight whose element count divides into whole scaler blocks."""
    numel = 1
    for d in shape:
        numel *= d
    return len(shape) == 2 and numel % (BLOCK_SIZE * SCALER_BLOCK_SIZE) == 0


def quantize_nf4(weight: torch.Tensor) -> NF4Tensor:
    return to_nf4(weight.contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)


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


def dequantize_nf4_rows(w: NF4Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of the weight in its dtype, with the same operations, in the same dtype and order
    as torchao (scale = q / factor + mean, w = nf4[code] * scale), so the bits are identical."""
    cols = w.shape[1]
    bs, sbs = w.block_size, w.scaler_block_size
    e0, e1 = start * cols, end * cols
    b0, b1 = e0 // bs, -(-e1 // bs)
    data = w.quantized_data[b0 * bs // 2 : b1 * bs // 2].to(torch.int32)
    factors = w.quantization_factor[b0 // sbs : -(-b1 // sbs)].repeat_interleave(sbs)[b0 % sbs : b0 % sbs + b1 - b0]
    scalers = (w.quantized_scalers[b0:b1] / factors).to(w.dtype) + w.scaler_mean
    table = _byte_pair_table(w)
    if table.dim() == 1:  # 16-bit weights: two values per int32 entry
        values = table.index_select(0, data).view(w.dtype)
    else:
        values = table.index_select(0, data).view(-1)
    values = values.view(b1 - b0, bs) * scalers.unsqueeze(-1)
    return values.view(-1)[e0 - b0 * bs : e1 - b0 * bs].view(end - start, cols)


def nf4_from_parts(
    shape: tuple[int, int],
    dtype: torch.dtype,
    quantized_data: torch.Tensor,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
) -> NF4Tensor:
    """Build an NF4Tensor from its inner tensors (synthetic benchmarks, reloading saved NF4 state)."""
    nf4 = quantize_nf4(torch.zeros(BLOCK_SIZE * SCALER_BLOCK_SIZE, dtype=dtype).view(1, -1)).nf4
    numel = shape[0] * shape[1]
    meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, quantized_data.device, False)
    return NF4Tensor(
        meta,
        BLOCK_SIZE,
        numel // BLOCK_SIZE,
        SCALER_BLOCK_SIZE,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        nf4.to(quantized_data.device),
    )


class NF4RoundTrip:
    """dequant(to_nf4(W)) by row range, for a W read by rows (the weights a QLoRA adapter was trained
    against), bit-identical to torchao's, without holding W: a first pass collects the per-block absmax
    (numel/64 values), which fixes the double-quantized scalers; then each row range is quantized to
    the nearest NF4 code and dequantized with those scalers, the same elementwise operations as torchao."""

    def __init__(self, read_rows, shape: tuple[int, int], dtype: torch.dtype, chunk_rows: int):
        self.read_rows, self.shape, self.dtype = read_rows, shape, dtype
        cols = shape[1]
        if cols % BLOCK_SIZE:
            raise ValueError("NF4 round trip by rows needs rows made of whole 64-blocks")
        absmax = [
            read_rows(s, min(s + chunk_rows, shape[0])).reshape(-1, BLOCK_SIZE).abs().max(dim=1).values
            for s in range(0, shape[0], chunk_rows)
        ]
        block_absmax = torch.cat(absmax)
        # torchao's double_quantize_scalers, on the block absmax vector
        mean = block_absmax.mean()
        centred = block_absmax - mean
        scaler_blocks = centred.view(-1, SCALER_BLOCK_SIZE)
        factor = 256 / (2 * scaler_blocks.abs().max(dim=1).values)
        quantized = (scaler_blocks * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
        # torchao's dequantize_scalers
        self.scalers = (quantized.view(-1, SCALER_BLOCK_SIZE) / factor.unsqueeze(-1)).flatten().to(dtype) + mean
        self.block_absmax = block_absmax
        self.nf4 = quantize_nf4(torch.zeros(1, BLOCK_SIZE * SCALER_BLOCK_SIZE, dtype=dtype)).nf4

    def rows(self, start: int, end: int) -> torch.Tensor:
        cols = self.shape[1]
        b0, b1 = start * cols // BLOCK_SIZE, end * cols // BLOCK_SIZE
        blocks = self.read_rows(start, end).reshape(-1, BLOCK_SIZE)
        scaled = (blocks / self.block_absmax[b0:b1].unsqueeze(-1)).flatten()
        codes = torch.empty(scaled.numel(), dtype=torch.long)
        for i in range(0, scaled.numel(), 2**20):  # torchao's chunking: bounds the [n, 16] distance table
            codes[i : i + 2**20] = (scaled[i : i + 2**20].unsqueeze(-1) - self.nf4).abs().min(dim=-1).indices
        values = self.nf4[codes].view(-1, BLOCK_SIZE) * self.scalers[b0:b1].unsqueeze(-1)
        return values.view(end - start, cols)
