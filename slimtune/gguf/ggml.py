"""ggml's block types: ``quantize(rows, type_name)`` for every quantized type slimtune writes to GGUF, byte
for byte what ggml's reference quantizers (``quantize_row_*_ref`` in ``ggml-quants.c``, the path
``llama_model_quantize`` takes without an importance matrix) write:

- the legacy 32-value blocks Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (in C where a compiler is,
  ``slimtune.gguf.kquant_kernel``; here in torch, a few passes over the blocks each, wherever it is not);
- the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: the iterative scale searches, in C where a compiler is
  (``slimtune.gguf.kquant_kernel``), else in torch (``slimtune.gguf.kquants``, ``kquants23``).

The ``gguf`` package quantizes the legacy types too, in numpy on one core; these run on every core the
process may use (``threads``), in pieces of cache-sized blocks, and agree with both ggml and the package
(tests/test_kquants.py). The C was read to learn each function; what byte identity needs:

- ``id = d ? 1.0f/d : 0.0f`` and the block scale ``d`` are float32 divisions (tensor by tensor: torch's
  division by a Python scalar may be a multiplication by its reciprocal);
- the signed maximum of |x| (Q4_0, Q5_0) and the minimum and maximum (Q4_1, Q5_1) are the first ones in
  the block, as the C's strict comparisons pick them (the sign of a zero reaches the file through ``m``);
- ``(int8_t)(x0 + 8.5f)`` truncates; Q8_0's ``roundf`` rounds half away from zero;
- fp16 by ggml's own ``ggml_compute_fp32_to_fp16`` (``kquants.fp16_bits``); a scale beyond float16 is a
  ``FloatingPointError`` (as the gguf package's numpy cast raises it), the caller's one error line.

Example::

    data = quantize(torch.randn(4, 4096), "Q8_0")   # uint8, 4 rows x 128 blocks x 34 bytes
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from slimtune.gguf import kquant_kernel, kquants
from slimtune.gguf.kquants import NonFiniteError, _scratch, finite_blocks, first_extreme, fp16_bits, le16, signed_absmax
from slimtune.gguf.kquants23 import _q2_k, _q3_k
from slimtune.gguf.pool import PiecePool, can_fork, register_error
from slimtune.tensors import all_finite

__all__ = ["BLOCK_BYTES", "BLOCK_VALUES", "NonFiniteError", "Quantizer", "quantize"]

register_error(NonFiniteError)  # a worker's comes back as itself


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """The float32 quotient ``t / c`` (one rounding)."""
    return t / torch.full_like(t, c)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1.0f/d : 0.0f``."""
    return torch.where(d != 0, torch.full_like(d, 1.0) / d, torch.zeros_like(d))


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """fp16 bits of block scales; FloatingPointError where one overflows (inf: llama.cpp would compute garbage)."""
    bits = fp16_bits(t)
    if bool(((bits & 0x7C00) == 0x7C00).any()):
        raise FloatingPointError("float16 overflow")
    return bits


def _to_int(v: torch.Tensor) -> torch.Tensor:
    """The C's ``(int8_t)v`` / ``(uint8_t)v`` of the levels, as int32: truncation; an infinite or NaN ``v``
    (a block whose scale is subnormal: ``1.0f/d`` overflows) converts to 0 (x86-64's cvttss2si gives
    0x80000000, whose low byte is 0). Finite levels are within the type (|x * id| <= the level count)."""
    return v.nan_to_num_(0.0, 0.0, 0.0).trunc_().to(torch.int32)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels (N, 32) -> qs (N, 16): byte j holds level j (low nibble) and level j + 16 (high)."""
    return (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """qh (N, 4): bit j of the little-endian uint32 is bit 4 of level j."""
    bits = ((q >> 4) & 1).view(-1, 4, 8)
    out = bits[..., 0].clone()
    for j in range(1, 8):
        out |= bits[..., j] << j
    return out


_JUST_BELOW_HALF = torch.tensor(0.5 - 2.0**-25)  # 0.49999997f, the float32 below 0.5


def _q8_0(b: torch.Tensor, check: bool = False) -> torch.Tensor:
    """d = amax / 127 (fp16), levels roundf(x * id): six passes over the values, into one temporary (this
    thread's, reused piece after piece) and the output.

    ``roundf`` (half away from zero) of |x0| <= 127 is ``(int8_t)copysign(|x0| + 0.49999997f, x0)``: the
    sum is exact or rounds within the same integer, except on a tie n + 0.5, where it rounds up to n + 1
    (a spacing of >= 2^-23 there), and 0.49999997 + 0.49999997 stays below 1 (0.5 itself would make 1).
    Where ``1.0f/d`` is infinite (d subnormal) the C's levels are (int8_t) of an infinity or NaN: 0
    (cvttss2si's 0x80000000, low byte 0), as with d == 0; so id is 0 there."""
    a = torch.abs(b, out=_scratch("q8_0", tuple(b.shape)))
    amax = a.amax(1)
    finite_blocks(check, amax)
    d = _div(amax, 127.0)
    inv = torch.full_like(d, 1.0) / d
    inv.masked_fill_(torch.isinf(inv), 0.0)
    a.mul_(inv[:, None]).add_(_JUST_BELOW_HALF).copysign_(b)  # |x| * id == |x * id|: in place, no temporaries
    out = torch.empty(b.shape[0], 34, dtype=torch.uint8)
    out[:, 2:].view(torch.int8).copy_(a)  # float -> int8 truncates toward zero, as the C's cast
    out[:, :2] = _fp16_bytes(d) if check else le16(_fp16(d))
    return out


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """``le16(_fp16(d))`` of finite scales (no NaN to give ggml's bits for): torch's cast is ggml's
    rounding (``kquants.fp16_bits``), its bytes as the file stores them on a little-endian host; two
    ops where the bit arithmetic takes eight."""
    half = d.half()
    if bool(torch.isinf(half).any()):
        raise FloatingPointError("float16 overflow")
    if sys.byteorder != "little":
        return le16(half.view(torch.int16).to(torch.int32) & 0xFFFF)
    return half.view(torch.uint8).view(-1, 2)


def _signed_scale(b: torch.Tensor, levels: int, check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q5_0: d = max / -levels/2 (max: the first value of largest |x|, +0.0 where every |x| is 0:
    the C's ``max`` starts at 0 and moves only on a larger |x|), and the levels
    ``MIN(levels - 1, (int8_t)(x * id + levels/2 + 0.5))``."""
    mx = signed_absmax(b, 1)  # NaN where a block holds one, inf where an infinity is the first extreme
    finite_blocks(check, mx)
    d = _div(mx, -levels / 2)
    q = _to_int((b * _inverse(d)[:, None]).add_(levels / 2 + 0.5)).clamp_max_(levels - 1)
    return d, q, torch.empty(0)


def _min_scale(b: torch.Tensor, levels: int, check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1: d = (max - min) / (levels - 1), the levels ``(x - min) * id + 0.5`` truncated, at most levels - 1."""
    mn, mx = b.amin(1), b.amax(1)  # where one is a zero, the first such element's (its sign: d and m)
    finite_blocks(check, mn, mx)
    mn = first_extreme(b, mn, mn == 0, lambda s: s.argmin(1), 1)
    mx = first_extreme(b, mx, mx == 0, lambda s: s.argmax(1), 1)
    d = _div(mx - mn, levels - 1)
    q = _to_int((b - mn[:, None]).mul_(_inverse(d)[:, None]).add_(0.5)).clamp_max_(levels - 1)
    return d, q, mn


def _q4_0(b: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, q, _ = _signed_scale(b, 16, check)
    return torch.cat([le16(_fp16(d)), _nibbles(q).to(torch.uint8)], dim=1)


def _q5_0(b: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, q, _ = _signed_scale(b, 32, check)
    return torch.cat([le16(_fp16(d)), _high_bits(q).to(torch.uint8), _nibbles(q).to(torch.uint8)], dim=1)


def _q4_1(b: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, q, m = _min_scale(b, 16, check)
    return torch.cat([le16(_fp16(d)), le16(_fp16(m)), _nibbles(q).to(torch.uint8)], dim=1)


def _q5_1(b: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, q, m = _min_scale(b, 32, check)
    return torch.cat([le16(_fp16(d)), le16(_fp16(m)), _high_bits(q).to(torch.uint8), _nibbles(q).to(torch.uint8)], dim=1)


_BlockFn = Callable[[torch.Tensor, bool], torch.Tensor]
"""A quantizer of blocks (N, block values), check -> their bytes (N, block bytes)."""


def _native(type_name: str, in_torch: _BlockFn) -> _BlockFn:
    """``type_name``'s quantizer of blocks (N, block values): the C loop (``kquant_kernel``) where it runs,
    else ``in_torch``; the same bytes and errors. With ``check``, NaN and infinities are a
    ``NonFiniteError`` first (``all_finite``: one sum of the values decides, as a rule)."""

    def run(x: torch.Tensor, check: bool = False) -> torch.Tensor:
        if kquant_kernel.loop_status() != "C":
            return in_torch(x, check)
        if check and not all_finite(x):  # one vectorized sum, not a per-block reduction (as long as the C call)
            raise NonFiniteError("NaN or infinite values")
        return kquant_kernel.quantize_blocks(x, type_name)

    return run


_KQUANTS = (("Q2_K", _q2_k), ("Q3_K", _q3_k), ("Q4_K", kquants._q4_k), ("Q5_K", kquants._q5_k), ("Q6_K", kquants._q6_k))
QUANTIZERS = {name: _native(name, fn) for name, fn in _KQUANTS}
"""Superblocks (N, 256), check -> their bytes (N, block bytes) (``check``: NaN or an infinity is a
``NonFiniteError``)."""

_TYPES: dict[str, tuple[Callable[[torch.Tensor, bool], torch.Tensor], int, int]] = {
    # type: (quantizer of blocks (N, block values), check -> (N, block bytes), values per block, blocks per piece)
    "Q8_0": (_native("Q8_0", _q8_0), 32, 16384),
    "Q4_0": (_native("Q4_0", _q4_0), 32, 16384),
    "Q4_1": (_native("Q4_1", _q4_1), 32, 16384),
    "Q5_0": (_native("Q5_0", _q5_0), 32, 16384),
    "Q5_1": (_native("Q5_1", _q5_1), 32, 16384),
    "Q2_K": (QUANTIZERS["Q2_K"], kquants.QK_K, 1024),
    "Q3_K": (QUANTIZERS["Q3_K"], kquants.QK_K, 1024),
    "Q4_K": (QUANTIZERS["Q4_K"], kquants.QK_K, 1024),
    "Q5_K": (QUANTIZERS["Q5_K"], kquants.QK_K, 1024),
    "Q6_K": (QUANTIZERS["Q6_K"], kquants.QK_K, 256),
}
"""Blocks per piece: cache-sized temporaries (Q6_K's 19 candidate scales over 256 values per superblock)
with few enough torch calls per value: smaller pieces pay more calls per value, larger ones spill the
cores' shared cache (the measured sizes: docs/benchmarks.md, "GGUF quantizers")."""
BLOCK_VALUES = {name: values for name, (_, values, _) in _TYPES.items()}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, **kquants.BLOCK_BYTES}


_WIDENED = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes taken as they are: float32, and the 16-bit floats (exact in float32)."""


def _blocks(rows: torch.Tensor, type_name: str) -> tuple[Callable[[torch.Tensor, bool], torch.Tensor], torch.Tensor, int]:
    """(the type's quantizer, ``rows`` as blocks (N, block values) in a dtype it takes, blocks per piece)."""
    if type_name not in _TYPES:
        raise ValueError(f"GGML block type {type_name!r}: expected one of {', '.join(_TYPES)}")
    fn, values, piece = _TYPES[type_name]
    if rows.shape[-1] % values:
        raise ValueError(f"rows of {rows.shape[-1]} values do not divide into {type_name}'s blocks of {values}")
    blocks = rows.detach()
    if blocks.dtype not in _WIDENED:
        blocks = blocks.float()
    return fn, blocks.reshape(-1, values), piece  # 16-bit rows stay so: each piece is widened where it is quantized


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).reshape(-1) if parts else torch.empty(0, dtype=torch.uint8)


class Quantizer:
    """``threads`` workers (default: torch's intra-op thread count, the cores the process may use) that
    quantize pieces of blocks, one torch thread each. A type the C loop quantizes (``kquant_kernel``, which
    releases the GIL for the whole piece) goes to threads of this process: nothing is copied and no process
    is forked. A type quantized in torch goes to forked processes (``slimtune.gguf.pool``: rows and bytes in
    shared memory; processes, because two threads of one process wait on each other's GIL hundreds of times
    a torch piece), started on first need. Torch's own intra-op parallelism is off in this process
    meanwhile (restored on exit): the cores are the workers'. ``submit`` returns at once; the export makes
    the next chunk's rows while the workers quantize this one. Where ``fork`` is missing (not Linux), torch
    pieces are quantized in the calling thread at ``submit``.

    Example::

        with Quantizer() as q:
            data = q.submit(torch.randn(64, 4096), "Q4_K")()   # the bytes, flat uint8
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self._pool: PiecePool | None = None
        self._lanes: ThreadPoolExecutor | None = None
        self._before = 0

    def __enter__(self) -> Quantizer:
        self._before = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if self._lanes is not None:
                self._lanes.shutdown(wait=True, cancel_futures=True)
            if self._pool is not None:
                self._pool.__exit__(exc_type, *exc)
        finally:
            self._pool, self._lanes = None, None
            torch.set_num_threads(self._before)

    def _processes(self) -> PiecePool | None:
        if self._pool is None and can_fork():
            self._pool = PiecePool(_work, self.threads, _SLOT_BYTES).__enter__()
        return self._pool

    def submit(self, rows: torch.Tensor, type_name: str, finite: bool = False) -> Callable[[], torch.Tensor]:
        """Start quantizing ``rows`` (see ``quantize``); the returned function waits and gives the bytes
        (or raises what a piece raised: ``FloatingPointError``, ``NonFiniteError``)."""
        parts = self.submit_parts(rows, type_name, finite)
        return lambda: _joined(parts())

    def submit_parts(self, rows: torch.Tensor, type_name: str, finite: bool = False) -> Callable[[], list[torch.Tensor]]:
        """``submit``, the bytes given as the pieces' flat uint8 tensors in order (no copy joins them)."""
        fn, blocks, piece = _blocks(rows, type_name)
        if kquant_kernel.runs(type_name):
            bf16 = blocks.dtype == torch.bfloat16  # widened inside the C loop, block by block
            return self._in_lanes(functools.partial(_c_bf16, type_name) if bf16 else functools.partial(_no_grad, fn), blocks, piece, finite)
        pool = self._processes()
        if pool is None:
            done = _in_thread(fn, blocks, piece, finite)
            return lambda: done
        per_block = max(blocks.shape[1] * blocks.element_size(), BLOCK_BYTES[type_name])
        segment = max(piece, _SLOT_BYTES // per_block // piece * piece)  # whole pieces to a slot
        waits = []
        for start in range(0, blocks.shape[0], segment):
            seg = blocks[start : start + segment]
            pieces = [(a, min(a + piece, seg.shape[0])) for a in range(0, seg.shape[0], piece)]
            sizes = [(b - a) * BLOCK_BYTES[type_name] for a, b in pieces]
            waits.append(pool.submit(seg, pieces, type_name, sizes, finite))
        return lambda: [part for wait in waits for part in wait()]

    def _in_lanes(self, run: _BlockFn, blocks: torch.Tensor, piece: int, finite: bool) -> Callable[[], list[torch.Tensor]]:
        """``run`` (piece, finite) -> bytes on the pieces of ``blocks`` on this process's threads (the C loop
        releases the GIL); ``blocks`` is held until every piece is done (the rows may be a pooled buffer)."""
        if self._lanes is None:
            self._lanes = ThreadPoolExecutor(self.threads, thread_name_prefix="slimtune-quantize")
        futures = [self._lanes.submit(run, blocks[i : i + piece], finite) for i in range(0, blocks.shape[0], piece)]

        def wait(held: torch.Tensor = blocks) -> list[torch.Tensor]:
            return [f.result().reshape(-1) for f in futures]

        return wait


_SLOT_BYTES = 16 * 1024 * 1024
"""One submission's rows in shared memory (the export's chunks are 4 MB of float32): 3 slots in, 3 out."""


def _work(type_name: str, piece: torch.Tensor, finite: bool) -> torch.Tensor:
    """A worker's piece: ``type_name``'s quantizer on it."""
    return _no_grad(_TYPES[type_name][0], piece, finite)


def _in_thread(fn: Callable[[torch.Tensor, bool], torch.Tensor], blocks: torch.Tensor, piece: int, finite: bool) -> list[torch.Tensor]:
    """Every piece of ``blocks`` quantized here, one after the other: their flat bytes, in order."""
    return [_no_grad(fn, blocks[i : i + piece], finite).reshape(-1) for i in range(0, blocks.shape[0], piece)]


def _c_bf16(type_name: str, piece: torch.Tensor, finite: bool) -> torch.Tensor:
    """A bf16 piece quantized by the C loop, which widens each block itself (and finds NaN and infinities
    with ``finite``): no float32 copy of the piece."""
    return kquant_kernel.quantize_bf16_blocks(piece, type_name, finite)


def _no_grad(fn: Callable[[torch.Tensor, bool], torch.Tensor], piece: torch.Tensor, finite: bool) -> torch.Tensor:
    """One piece quantized, widened to float32 here (a 16-bit piece: cache-sized, on the pool's thread)."""
    with torch.no_grad():
        if piece.dtype != torch.float32:  # into this thread's buffer: a fresh one per piece costs page faults
            piece = _scratch("widened", tuple(piece.shape)).copy_(piece)
        return fn(piece, finite)


def quantize(rows: torch.Tensor, type_name: str, threads: int | None = None, finite: bool = False) -> torch.Tensor:
    """fp32 rows (..., k * block values; bf16 and fp16 rows are taken as their exact fp32 values) quantized
    to ``type_name`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K): the bytes ggml's reference
    quantizer writes for them, as a flat uint8 tensor (rows one after the other, blocks in order).
    ``FloatingPointError`` where a legacy block's scale overflows float16. NaN and infinities are
    quantized as ggml quantizes them, or with ``finite`` are a ``NonFiniteError`` (a ``ValueError``),
    found from the blocks' own maxima and minima (no pass of its own over the values).
    The blocks go in cache-sized pieces to ``threads`` worker processes (``Quantizer``; 1: this thread).
    Example: ``quantize(torch.randn(2, 256), "Q6_K").numel() == 2 * 210``"""
    fn, blocks, piece = _blocks(rows, type_name)
    if (threads or torch.get_num_threads()) > 1 and blocks.shape[0] > piece:
        with Quantizer(threads) as q:
            return q.submit(rows, type_name, finite)()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _joined(_in_thread(fn, blocks, piece, finite))
    finally:
        torch.set_num_threads(before)
