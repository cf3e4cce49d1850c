"""ggml's K-quant block formats quantized in torch, vectorized over blocks: Q4_K, Q5_K and Q6_K here, Q2_K and
Q3_K in ``kquants23`` (on these helpers), byte for byte what ggml's reference quantizers
(``quantize_row_q2_K_ref`` ... ``quantize_row_q6_K_ref`` in ``ggml-quants.c``, the path
``llama_model_quantize`` takes without an importance matrix) write. The ``gguf`` package only dequantizes
these types, hence this module. It is the fallback: where a C compiler is, ``slimtune.gguf.kquant_kernel``
quantizes (the same algorithm in C, several times faster) and ``slimtune.gguf.ggml`` takes its bytes.

The C was read to learn the algorithm (``make_qkx2_quants``, ``make_qx_quants``, ``make_q3_quants``,
``nearest_int``); the code here is a vectorized re-derivation. What byte identity needs, each handled below:

- every float operation is an IEEE float32 operation in the C's order: sums are accumulated one element
  at a time (``_running_sum``; torch's reductions are pairwise), ``a * b + c`` is two roundings (ggml-base
  is compiled without FMA contraction on x86-64: no ``-march`` flags reach ``ggml-quants.c``), and the
  scalar constants (``rmin + rdelta * is + nmax``) are float32 arithmetic (numpy float32 scalars);
- ``nearest_int`` is ggml's bit trick (add 1.5 * 2**23, keep the low mantissa bits): round half to even
  inside its range and ggml's exact garbage outside it (an infinite or NaN argument); where a bound on the
  argument proves it inside (``_levels``: every block but those whose span overflows), the clamped level is
  torch's round half to even and a clamp instead (two float passes);
- comparisons are the C's strict ``<`` / ``>`` applied sequentially (first best wins, NaN never wins);
- ``sqrtf`` is correctly rounded, torch's float32 ``sqrt`` is not (``_sqrtf``);
- the block scales are rounded to fp16 by ggml's own ``ggml_compute_fp32_to_fp16`` (``fp16_bits``);
- integer narrowing (``uint8_t ls = nearest_int(...)``, the int8 Q6_K scales) wraps modulo 256, as C does.

Speed (the scale searches are most of the work: 21 candidate scales for each Q4_K sub-block, 19 for Q6_K):
every pass is a torch op over all the blocks of a piece at once (cache-sized, ``slimtune.gguf.ggml``),
each sequential sum is one ``index_add_`` (the loop inside torch, not one Python call per term: the two
quantizer threads share one GIL, and 16-32 calls per sum kept the second thread waiting), the three sums
of a candidate in one pass over a (n, 3, blocks) buffer,
no levels are kept per candidate (the winner's are made again), Q6_K's candidates, which do not depend
on each other, are computed together (and what each would make the best, before the sequential choice),
a Q4_K/Q5_K block's search state moves in one bitwise select (``_select``), and the large buffers are each thread's own,
reused piece after piece (``_scratch``: a fresh one per piece cost more in page faults than Q6_K's
arithmetic).

Example::

    data = slimtune.gguf.ggml.quantize(torch.randn(4, 512), "Q4_K")   # uint8, 4 rows x 2 blocks x 144 bytes
"""

from __future__ import annotations

import threading

import numpy as np
import torch

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

_F32 = np.float32
_GROUP_MAX_EPS = float(_F32(1e-15))  # 1e-15f


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int`` of float32 values, as int32: ``(bits(v + 12582912.f) & 0x7fffff) - 0x400000``."""
    return nearest_int_(v + 12582912.0, added=True)


def nearest_int_(v: torch.Tensor, added: bool = False) -> torch.Tensor:
    """``nearest_int`` in place on the float32 temporary ``v`` (returned as its int32 view): one buffer where
    the expression made four (each a fresh allocation the kernel zeroes). ``added``: 1.5 * 2**23 is in."""
    if not added:
        v.add_(12582912.0)
    return v.view(torch.int32).bitwise_and_(0x7FFFFF).sub_(0x400000)


def fp16_bits(f: torch.Tensor) -> torch.Tensor:
    """float32 -> IEEE fp16 bits (int32 values 0..65535) exactly as ggml's ``ggml_compute_fp32_to_fp16``
    computes them: round to nearest even (torch's cast: the same rounding, subnormal results and overflow to
    inf included, checked against ggml's C on bit patterns of every exponent in tests/test_kquants.py);
    NaN -> 0x7e00 with its sign, as ggml's bit arithmetic gives it. Three ops where the bit arithmetic took
    fifteen: these run once per block scale."""
    bits = f.half().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(torch.isnan(f), (bits & 0x8000) | 0x7E00, bits)


def fp16_value(bits: torch.Tensor) -> torch.Tensor:
    """fp16 bits (int32 0..65535) -> float32 (exact)."""
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.float16).float()


def le16(bits: torch.Tensor) -> torch.Tensor:
    """int32 fp16 bits (..., ) -> little-endian bytes (..., 2) as uint8."""
    return torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8)


class NonFiniteError(ValueError):
    """A block holds NaN or an infinity (ggml would write garbage for it)."""


def finite_blocks(check: bool, *reductions: torch.Tensor) -> None:
    """With ``check``, ``NonFiniteError`` unless every value is finite: ``reductions`` are per-block
    maxima / minima of the values (NaN-propagating: a NaN or an infinity in a block makes its max or its
    min non-finite), so the check is a pass over one value per block, not over the values. Without it,
    NaN and infinities are quantized as ggml quantizes them (its bytes: tests/test_kquants.py)."""
    if not check:
        return
    for r in reductions:
        if not bool(torch.isfinite(r).all()):
            raise NonFiniteError("NaN or infinite values")


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 buffer of ``shape`` kept by this thread for ``name`` and reused by its next piece of the
    same shape (uninitialised). A fresh multi-MB tensor per piece costs page faults: glibc maps every
    same-sized large allocation anew (its mmap threshold rises to the freed size, never above it), and
    the kernel zeroes the pages: page faults many times the input's size."""
    held = getattr(_SCRATCH, name, None)
    if held is None or tuple(held.shape) != tuple(shape):
        held = torch.empty(shape)
        setattr(_SCRATCH, name, held)
    return held


def _select(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``torch.where(mask, new, old)`` for float32 or int32 ``new`` and ``old`` of one dtype, by their bits
    (``old ^ ((old ^ new) & -mask)``: every bit kept, NaN payloads and signed zeros too); ``in_place``: into
    ``old`` (its shape the result's). torch's ``where`` on a bool mask runs a scalar kernel on the CPU,
    several times slower than these three integer passes, and the search state moves by it 21 times a piece."""
    bits = torch.int32
    o = old.view(bits) if old.dtype != bits else old
    n = new.view(bits) if new.dtype != bits else new
    change = torch.bitwise_xor(o, n).bitwise_and_(mask.to(bits).neg_())
    return (o.bitwise_xor_(change) if in_place else change.bitwise_xor_(o)).view(old.dtype)


def _over(c: float, t: torch.Tensor) -> torch.Tensor:
    """The float32 quotient ``c / t`` (one rounding: a Python scalar's ``c / t`` is ``t.reciprocal() * c``)."""
    return torch.full_like(t, c) / t


def _sqrtf(t: torch.Tensor) -> torch.Tensor:
    """C's ``sqrtf``: the correctly rounded float32 square root. torch's float32 ``sqrt`` is not (1 ulp off on
    a fraction of a percent of random inputs on an AVX-512 build); the float64 root rounded to float32 is (the
    double rounding is harmless for sqrt: 53 >= 2 * 24 + 2 bits)."""
    return t.double().sqrt().float()


def first_extreme(x: torch.Tensor, values: torch.Tensor, need: torch.Tensor, arg, dim: int) -> torch.Tensor:
    """``values`` (a reduction of the 2-D ``x`` over ``dim``: amax, amin) with, where ``need`` (a tie, a zero:
    rare), the value of the first element ``arg`` picks (argmax/argmin: the first of equal values, as the
    C's sequential strict comparisons pick it; its sign of zero). torch's argmax over a short dim is many
    times slower than amax, hence only there."""
    idx = need.nonzero()[:, 0]
    if idx.numel():
        sub = x.index_select(1 - dim, idx)  # 2-D: the blocks needing it
        values = values.clone()
        values[idx] = sub.gather(dim, arg(sub).unsqueeze(dim)).squeeze(dim)
    return values


def signed_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The C's ``amax = 0; max = 0; for v: if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` over ``dim``:
    the first value of largest magnitude, +0.0 where all are zero."""
    hi, lo = x.amax(dim), x.amin(dim)
    mx = torch.where(hi >= -lo, hi, lo) + 0.0  # + 0.0: -0.0 -> +0.0 (all zero), nothing else changes
    return first_extreme(x, mx, (hi == -lo) & (hi > 0), lambda s: s.abs().argmax(dim), dim)


def _running_sum(terms: torch.Tensor, start: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``s = start (or 0); for t in terms: s += t`` over the first dimension, float32 one addition at a time
    (into ``out``, shaped like one term, when given).

    One ``index_add_`` with every index 0: torch adds the slices into the accumulator in the order of the
    index (its documented semantics; the CPU kernel is that loop, in the accumulator's dtype), so the sum is
    the C's sequential one (another order rounds most wide-range sums differently: tests/test_kquants.py), and it
    is one call where a Python loop of ``add_`` made one per term: 16-32 per sum, each holding the GIL the
    other quantizer thread waits for."""
    if out is None:
        out = torch.zeros_like(terms[0]) if start is None else start.clone()
    elif start is None:
        out.zero_()
    else:
        out.copy_(start)
    return out.unsqueeze(0).index_add_(0, _zeros_index(terms.shape[0]), terms).squeeze(0)


_ZERO_INDEX: dict[int, torch.Tensor] = {}


def _zeros_index(n: int) -> torch.Tensor:
    """The int64 index of ``n`` zeros ``_running_sum`` adds by (made once per length; never written)."""
    index = _ZERO_INDEX.get(n)
    if index is None:
        index = _ZERO_INDEX.setdefault(n, torch.zeros(n, dtype=torch.int64))
    return index


# --- Q4_K, Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min ------------------------------------------

_FAST_RANGE = 2.0**21
"""Where every |v| is below this (half nearest_int's range), ``nearest_int(v)`` is torch's round half to
even (its bit trick is exact there), so the levels are made in float arithmetic."""


def _levels(v: torch.Tensor, lo: int, hi: int, fast: bool | None = None) -> torch.Tensor:
    """``max(lo, min(hi, nearest_int(v)))`` as float32, in place on ``v``: where every |v| is under
    ``_FAST_RANGE`` (always, but for spans that overflow to inf and the like: ``fast`` when the caller
    knows, else one min/max pass says so), two float passes (round half to even, clamp: exact there);
    else ggml's integer bit trick."""
    if fast is None:
        low, high = torch.aminmax(v)  # NaN propagates: a NaN or an infinity fails the test
        fast = -_FAST_RANGE < float(low) and float(high) < _FAST_RANGE
    if fast:
        return v.round_().clamp_(lo, hi)
    return nearest_int(v).clamp_(lo, hi).float()


def _make_qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, check: bool = False, mad: bool = False):
    """ggml's ``make_qkx2_quants`` on sub-blocks ``x`` (n, M): values along dim 0, one sub-block per
    column, its error the weighted squares (``mad``: the weighted absolute values, as Q2_K asks for it).

    Returns (scale (M,), the_min (M,), ``levels_of``): ``levels_of(idx)`` makes the winners' levels L of the
    sub-blocks ``idx`` as (len(idx), n) int32 in 0..nmax. The callers need them only where a sub-block's
    quantized scale is 0 (elsewhere the C overwrites them from that scale), so they are not made for all.

    The candidate scales go in the C's order, each from the best ``min`` so far (a better candidate moves
    it), every block at once. The levels are not kept per candidate: each block remembers the winner's
    (iscale, min) and its levels are made again from them (the same float operations). A block's
    state (best error, scale, min, the winner's iscale and min, max - min) is one (6, M) tensor, moved by
    one select; the levels and the errors are made in place in one buffer, the sums in the thread's own.
    The candidates' levels take the fast path (``_levels``) unchecked, while the reach of their arguments
    is kept per block; should any reach leave the fast range (spans that overflow, NaN), the search is run
    again with every candidate's levels checked. A flat block (max == min: its scale and levels are
    overwritten with 0) computes with a span of 1, so its levels are finite (all 0: never a better
    candidate, D = 0) and the fast level path holds."""
    result = _qkx2_search(x, w, nmax, rmin, rdelta, nstep, check, mad, checked=False)
    return result if result is not None else _qkx2_search(x, w, nmax, rmin, rdelta, nstep, check, mad, checked=True)


# The pairs of the sums [sum_w, sum_x, sum_l, sum_l2, sum_xl] whose products make D = sum_w*sum_l2 - sum_l*sum_l,
# the scale's numerator sum_w*sum_xl - sum_x*sum_l and the min's sum_l2*sum_x - sum_l*sum_xl (each the C's
# product, one rounding: a float product does not depend on its operands' order)
_QKX2_LEFT = torch.tensor([0, 2, 0, 1, 3, 2])
_QKX2_RIGHT = torch.tensor([3, 2, 4, 2, 1, 4])


def _qkx2_search(x, w, nmax, rmin, rdelta, nstep, check, mad, checked):
    """``_make_qkx2``'s search; with ``checked`` False, None where a candidate's levels left the fast range.

    A candidate's (M,)-sized arithmetic goes in few calls: its sums sit beside sum_w and sum_x in one
    (5, M) buffer, the six products of D and the two numerators are one multiply of two gathers of it, the
    three differences one subtraction and the scale and min one division, written straight into the
    candidate's row of the state (its error, scale, min, iscale, the min its levels used, max - min)."""
    lo, mx = x.amin(0), x.amax(0)
    finite_blocks(check, lo, mx)
    n, m_blocks = x.shape
    sums5 = _scratch("qkx2_sums5", (5, m_blocks))  # sum_w, sum_x, then the candidate's sum_l, sum_l2, sum_xl
    _running_sum(w[1:], w[0], out=sums5[0])
    wx = torch.mul(w, x, out=_scratch("qkx2_wx", tuple(x.shape)))
    _running_sum(wx[1:], wx[0], out=sums5[1])
    mn = torch.where(lo > 0, torch.zeros_like(lo), lo)
    flat = mx == mn
    span = torch.where(flat, torch.ones_like(mx), mx - mn)
    iscale = _over(nmax, span)
    scale = _over(1.0, iscale)
    v = _scratch("qkx2_levels", tuple(x.shape))
    ends = torch.stack([lo, mx])

    def levels(isc: torch.Tensor, m: torch.Tensor, fast: bool | None = None) -> torch.Tensor:
        if fast is None:  # |isc * (x - m)| is at most this (rounding is monotonic: the extremes of x - m are at x's)
            bound = torch.maximum((lo - m).abs_(), (mx - m).abs_()).mul_(isc.abs())
            fast = bool((bound < _FAST_RANGE).all())  # NaN and inf fail the test
        return _levels(torch.sub(x, m, out=v).mul_(isc), 0, nmax, fast)  # the C's iscale * (x - min)

    def error(lf: torch.Tensor, s: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        diff = lf.mul_(s).add_(m).sub_(x)  # scale * L + min - x, in place on the levels
        return _running_sum((diff.abs_() if mad else diff.mul_(diff)).mul_(w), out=out)

    # the state: best error, scale, min, the winner's iscale and the min its levels used, max - min
    state = torch.stack([torch.empty_like(mn), scale, mn, iscale, mn, span])
    error(levels(iscale, mn), scale, mn, out=state[0])
    best, _, mn, _, _, span = state  # views: the select below moves them in place
    sums = _scratch("qkx2_sums", (n, 3, m_blocks))
    left, right = _scratch("qkx2_left", (6, m_blocks)), _scratch("qkx2_right", (6, m_blocks))
    terms = _scratch("qkx2_terms", (3, m_blocks))  # D, the scale's numerator, the min's
    cand = _scratch("qkx2_candidate", (6, m_blocks))
    tried = _scratch("qkx2_tried", (nstep + 1, 2, m_blocks))  # each candidate's (iscale, min): its reach, after
    steps = [torch.tensor(_F32(rmin) + _F32(rdelta) * _F32(i) + _F32(nmax)) for i in range(nstep + 1)]
    for i, step in enumerate(steps):
        isc = torch.div(step, span, out=cand[3])  # the C's (rmin + rdelta*is + nmax)/(max - min): a true division
        cand[4].copy_(mn)
        if checked:
            lf = levels(isc, mn)
        else:
            tried[i].copy_(cand[3:5])
            lf = levels(isc, mn, True)
        wl = torch.mul(w, lf, out=sums[:, 0])
        torch.mul(wl, lf, out=sums[:, 1])
        torch.mul(wl, x, out=sums[:, 2])
        _running_sum(sums, out=sums5[2:])
        products = torch.index_select(sums5, 0, _QKX2_LEFT, out=left).mul_(torch.index_select(sums5, 0, _QKX2_RIGHT, out=right))
        D = torch.sub(products[0::2], products[1::2], out=terms)[0]
        this_scale, this_min = torch.div(terms[1:], D, out=cand[1:3])  # the C's (...)/D for both
        clipped = this_min > 0
        if bool(clipped.any()):
            this_min.masked_fill_(clipped, 0.0)
            this_scale.copy_(torch.where(clipped, sums5[4] / sums5[3], this_scale))  # sum_xl / sum_l2
        cur_error = error(lf, this_scale, this_min, out=cand[0])
        better = (D > 0) & (cur_error < best)
        torch.sub(mx, this_min, out=cand[5])
        _select(better, cand, state, in_place=True)
    if not checked:
        # |isc * (x - m)| of every candidate at x's extremes (rounding is monotonic, as in levels())
        reach = torch.sub(ends, tried[:, 1:], out=_scratch("qkx2_reach", (nstep + 1, 2, m_blocks)))
        if not float(reach.abs_().mul_(tried[:, :1].abs_()).amax()) < _FAST_RANGE:  # amax keeps a NaN: it fails
            return None
    _, scale, mn, win_iscale, win_min, _ = state

    def levels_of(idx: torch.Tensor) -> torch.Tensor:
        """The winners' levels of the sub-blocks ``idx`` (k,), as (k, n) int32 (a flat sub-block's: 0)."""
        found = _levels(x.index_select(1, idx).sub_(win_min[idx]).mul_(win_iscale[idx]), 0, nmax).to(torch.int32)
        return found.masked_fill_(flat[idx], 0).t()

    return torch.where(flat, torch.zeros_like(scale), scale), -mn, levels_of


def _max_positive(v: torch.Tensor) -> torch.Tensor:
    """``m = 0; for x in v (last dim): if (x > m) m = x``: the largest positive value, +0.0 where none is
    (NaN is never greater, so it is left out, as are -0.0 and the negatives)."""
    return torch.where(v > 0, v, 0.0).amax(-1)


def _quantize_qkx(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, check: bool):
    """The shared part of Q4_K and Q5_K on superblocks ``x`` (N, 256): fp16 d and dmin bits (N,), the 12
    packed scale bytes (N, 12) and the levels L (N, 256) in 0..nmax (in this thread's buffer: packed before
    its next piece)."""
    n = x.shape[0]
    sub = _scratch("qkx_sub", (32, n * 8)).copy_(x.reshape(n * 8, 32).t())  # (32, M): values along dim 0
    w = torch.mul(sub, sub, out=_scratch("qkx_weights", tuple(sub.shape)))
    av_x = _sqrtf(_running_sum(w) / 32.0)
    w = torch.abs(sub, out=w).add_(av_x)  # the C's av_x + fabsf(x[l])
    scales, mins, levels_of = _make_qkx2(sub, w, nmax, rmin, rdelta, nstep, check)
    scales, mins = scales.view(n, 8), mins.view(n, 8)
    max_scale, max_min = _max_positive(scales), _max_positive(mins)
    inv_scale = torch.where(max_scale > 0, _over(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _over(63.0, max_min), torch.zeros_like(max_min))
    ls = (nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp_max(63)
    lm = (nearest_int(inv_min[:, None] * mins) & 0xFF).clamp_max(63)
    packed = torch.cat(
        [ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6), (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], dim=1
    )
    d_bits, dmin_bits = fp16_bits(max_scale / 63.0), fp16_bits(max_min / 63.0)
    d = fp16_value(d_bits)[:, None] * ls.float()
    dm = fp16_value(dmin_bits)[:, None] * lm.float()
    xs = x.view(n, 8, 32)
    requant = torch.add(xs, dm[..., None], out=_scratch("qkx_requant", tuple(xs.shape)))  # a fresh one: page faults
    L = nearest_int_(requant.div_(d[..., None])).clamp_(0, nmax)
    _keep_search_levels(L.view(n * 8, 32), d.view(-1) == 0, levels_of)
    return d_bits, dmin_bits, packed, L.reshape(n, 256)


def _keep_search_levels(L: torch.Tensor, unscaled: torch.Tensor, levels_of) -> None:
    """Where a sub-block's quantized scale is 0 (``unscaled``, rare: a zero block, a scale far below the
    superblock's largest), the C keeps ``make_qkx2``'s levels: those rows of ``L`` (sub-blocks, values)
    taken from the search."""
    idx = unscaled.nonzero()[:, 0]
    if idx.numel():
        L[idx] = levels_of(idx)


def _q4_k(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, dmin, scales, L = _quantize_qkx(x, 15, -1.0, 0.1, 20, check)
    pairs = L.view(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([le16(d), le16(dmin), scales.to(torch.uint8), qs.to(torch.uint8)], dim=1)


def _q5_k(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    d, dmin, scales, L = _quantize_qkx(x, 31, -0.5, 0.1, 15, check)
    pairs = L.view(-1, 4, 2, 32)
    low = pairs & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (pairs >> 4) & 1  # bit 2p of qh[j] from L[64p + j], bit 2p + 1 from L[64p + 32 + j]
    shifts = torch.arange(8, dtype=torch.int32).view(1, 4, 2, 1)
    qh = (high << shifts).sum(dim=(1, 2))
    return torch.cat([le16(d), le16(dmin), scales.to(torch.uint8), qh.to(torch.uint8), qs.to(torch.uint8)], dim=1)


# --- Q6_K: 16 sub-blocks of 16 with an 8-bit scale ------------------------------------------------------

_QX_STEPS = [0, *range(-9, 0), *range(1, 10)]
"""make_qx_quants' candidate scales: the first (-nmax / max), then is = -9..-1, 1..9 in the C's order."""


def _make_qx(x: torch.Tensor, nmax: int, check: bool = False):
    """ggml's ``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` on sub-blocks ``x`` (n, M): values
    along dim 0. Returns (scale (M,), L (n, M) int32 in 0..2*nmax-1). Every candidate scale's sums at
    once (n, candidates, M); the choice among them in the C's order (each compared with the best so far)."""
    mx = signed_absmax(x, 0)
    finite_blocks(check, mx)
    amax = mx.abs()
    zero = amax < _GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)  # all-zero sub-blocks: any scale (overwritten below)
    consts = torch.from_numpy(np.array([-(_F32(nmax) + _F32(0.1) * _F32(i)) for i in _QX_STEPS], dtype=np.float32))
    iscales = consts[:, None] / mx  # (S, M): the C's -(nmax + 0.1f*is) / max
    # |iscale * x| <= |iscale| * amax ~ nmax + 1 wherever iscale is finite (an infinite one: a subnormal max)
    fast = bool(torch.isfinite(iscales).all())
    shape = (x.shape[0], iscales.shape[0], x.shape[1])
    lf = _levels(torch.mul(x[:, None, :], iscales, out=_scratch("qx_levels", shape)), -nmax, nmax - 1, fast)  # (n, S, M)
    w = x * x
    wl = torch.mul(lf, w[:, None, :], out=_scratch("qx_products", shape))
    suml2 = _running_sum(wl.mul_(lf))  # (w * l) * l
    sumlx = _running_sum(lf.mul_((w * x)[:, None, :]))  # (w * x) * l, as the C's w*x[i]*l
    lf = wl = None
    # what each candidate would make the best: scale = sumlx / suml2, best = scale * sumlx (all at once)
    ratio = sumlx / suml2
    cand_best = ratio * sumlx
    # the C's suml2 > 0 && sumlx*sumlx > best*suml2 as one comparison: -inf (never greater) where suml2 <= 0
    square = torch.where(suml2 > 0, sumlx * sumlx, -torch.inf).unbind(0)
    scale0 = torch.where(suml2[0] != 0, ratio[0], torch.zeros_like(ratio[0]))
    best = scale0 * sumlx[0]
    pick = torch.zeros_like(mx, dtype=torch.int64)
    for s, (sq, l2, cb) in enumerate(zip(square, suml2.unbind(0), cand_best.unbind(0), strict=True)):
        if s:
            better = sq > best * l2
            best = torch.where(better, cb, best)
            pick.masked_fill_(better, s)
    scale = torch.where(pick == 0, scale0, ratio.gather(0, pick[None])[0])
    chosen = iscales.gather(0, pick[None])  # the winner's iscale: its levels again (cheaper than keeping all)
    L = _levels(x * chosen, -nmax, nmax - 1, fast).to(torch.int32)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.full_like(L, -nmax), L) + nmax
    return scale, L


def _first_absmax(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C's ``amax = 0; max = 0; for s in scales (dim 1): if (fabsf(s) > amax) { amax = fabsf(s); max = s; }``:
    (amax, max) per superblock, the first scale of largest magnitude (+0 where all are 0)."""
    if bool(torch.isfinite(scales).all()):
        max_scale = signed_absmax(scales, 1)
        return max_scale.abs(), max_scale
    max_abs, max_scale = torch.zeros_like(scales[:, 0]), torch.zeros_like(scales[:, 0])  # the loop, which a NaN never enters
    for j in range(scales.shape[1]):
        a = scales[:, j].abs()
        bigger = a > max_abs
        max_abs = torch.where(bigger, a, max_abs)
        max_scale = torch.where(bigger, scales[:, j], max_scale)
    return max_abs, max_scale


def _q6_k(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    n = x.shape[0]
    sub = x.reshape(n * 16, 16).t().contiguous()
    scales, L = _make_qx(sub, 32, check)
    scales, L = scales.view(n, 16), L.t().reshape(n, 16, 16)
    max_abs, max_scale = _first_absmax(scales)
    zero = max_abs < _GROUP_MAX_EPS
    iscale = _over(-128.0, max_scale)
    d_bits = fp16_bits(_over(1.0, iscale))
    sc = nearest_int(iscale[:, None] * scales).clamp_max(127) & 0xFF  # stored as int8_t
    sc_value = torch.where(sc > 127, sc - 256, sc)
    d = fp16_value(d_bits)[:, None] * sc_value.float()
    requant = nearest_int_(torch.div(x.view(n, 16, 16), d[..., None])).clamp_(-32, 31).add_(32)
    L = _select((d != 0)[..., None], requant, L).reshape(n, 2, 4, 32)
    low, high = L & 0xF, L >> 4
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), sc.to(torch.uint8), le16(d_bits)], dim=1)
    return torch.where(zero[:, None], torch.zeros_like(out), out)
