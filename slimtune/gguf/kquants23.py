"""ggml's Q2_K and Q3_K quantized in torch (the fallback of ``slimtune.gguf.kquant_kernel``'s C), byte for
byte what ``quantize_row_q2_K_ref`` and ``quantize_row_q3_K_ref`` write: 16 sub-blocks of 16 values with a
4-bit scale and min (Q2_K, ``make_qkx2_quants`` with absolute errors) or a 6-bit signed scale (Q3_K,
``make_q3_quants``). The shared arithmetic (ggml's rounding, sequential sums, fp16) is
``slimtune.gguf.kquants``'; what byte identity needs is said there.

Example::

    data = _q2_k(torch.randn(4, 256))   # uint8 (4, 84)
"""

from __future__ import annotations

import torch

from slimtune.gguf.kquants import (
    _GROUP_MAX_EPS,
    _first_absmax,
    _keep_search_levels,
    _levels,
    _make_qkx2,
    _max_positive,
    _over,
    _running_sum,
    _scratch,
    _select,
    finite_blocks,
    fp16_bits,
    fp16_value,
    le16,
    nearest_int,
    nearest_int_,
    signed_absmax,
)


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """Levels (N, 256) in 0..3 -> the 64 ``qs`` bytes: byte 32h + l holds L[128h + l + 32k] at bits 2k."""
    q = L.view(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _q2_k(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    """``quantize_row_q2_K_ref``: ``make_qkx2_quants(16, 3, x, |x|, ..., -0.5, 0.1, 15, use_mad=true)`` per
    sub-block, its scales and mins to 4 bits against their largest, then the levels again from those."""
    n = x.shape[0]
    sub = _scratch("qkx_sub", (16, n * 16)).copy_(x.reshape(n * 16, 16).t())
    scales, mins, levels_of = _make_qkx2(
        sub, torch.abs(sub, out=_scratch("qkx_weights", tuple(sub.shape))), 3, -0.5, 0.1, 15, check, mad=True
    )
    scales, mins = scales.view(n, 16), mins.view(n, 16)
    max_scale, max_min = _max_positive(scales), _max_positive(mins)
    has_scale, has_min = (max_scale > 0)[:, None], (max_min > 0)[:, None]
    zero = torch.zeros((), dtype=torch.int32)
    ls = torch.where(has_scale, nearest_int(_over(15.0, max_scale)[:, None] * scales), zero)
    lm = torch.where(has_min, nearest_int(_over(15.0, max_min)[:, None] * mins), zero)
    packed = ((ls & 0xFF) | (lm << 4)) & 0xFF  # y.scales[j] = l; y.scales[j] |= (l << 4): uint8 stores
    d_bits = fp16_bits(torch.where(has_scale[:, 0], max_scale / 15.0, 0.0))
    dmin_bits = fp16_bits(torch.where(has_min[:, 0], max_min / 15.0, 0.0))
    d = fp16_value(d_bits)[:, None] * (packed & 0xF).float()
    dm = fp16_value(dmin_bits)[:, None] * (packed >> 4).float()
    requant = torch.add(x.view(n, 16, 16), dm[..., None], out=_scratch("qkx_requant", (n, 16, 16)))
    L = nearest_int_(requant.div_(d[..., None])).clamp_(0, 3)
    _keep_search_levels(L.view(n * 16, 16), d.view(-1) == 0, levels_of)
    L = L.reshape(n, 256)
    return torch.cat([packed.to(torch.uint8), _pack_2bit(L).to(torch.uint8), le16(d_bits), le16(dmin_bits)], dim=1)


def _make_q3(x: torch.Tensor, nmax: int, check: bool = False):
    """ggml's ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` on sub-blocks ``x`` (n, M): values along dim 0.
    Returns (scale (M,), L (n, M) int32: level + nmax, 0 for an all-zero sub-block). The C's refinement
    visits the values one at a time (each change moves the sums the next one sees): here each visit is a
    step over the sub-blocks at once, up to 5 rounds of n steps; a sub-block that a round left unchanged
    leaves the next rounds (the C's per-block break: it would change nothing again)."""
    mx = signed_absmax(x, 0)
    finite_blocks(check, mx)
    zero = mx.abs() < _GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)  # all-zero sub-blocks: any scale (overwritten below)
    L = _levels(x * _over(float(-nmax), mx), -nmax, nmax - 1)  # the C's iscale = -nmax / max, a float division
    w = x * x
    wx = w * x
    sumlx = _running_sum(wx * L)  # w*x[i]*l
    suml2 = _running_sum(w * L * L)  # w*l*l
    live = torch.arange(x.shape[1])  # the sub-blocks still changing: each round works on these only
    for _ in range(5):
        xa, wa, wxa, La = x[:, live], w[:, live], wx[:, live], L[:, live]
        slx_a, sl2_a = sumlx[live], suml2[live]
        changed = torch.zeros(live.shape, dtype=torch.bool)
        for i in range(x.shape[0]):
            li = La[i]
            slx = slx_a - wxa[i] * li
            sl2 = sl2_a - wa[i] * li * li
            new = nearest_int(xa[i] * sl2 / slx).clamp_(-nmax, nmax - 1).float()
            accept = (slx > 0) & (new != li)
            slx = slx + wxa[i] * new
            sl2 = sl2 + wa[i] * new * new
            accept &= (sl2 > 0) & (slx * slx * sl2_a > slx_a * slx_a * sl2)
            La[i] = torch.where(accept, new, li)
            slx_a = torch.where(accept, slx, slx_a)
            sl2_a = torch.where(accept, sl2, sl2_a)
            changed |= accept
        L[:, live], sumlx[live], suml2[live] = La, slx_a, sl2_a
        live = live[changed]
        if not live.numel():
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.zeros_like(L), L + nmax)
    return scale, L.to(torch.int32)


def _q3_k(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    """``quantize_row_q3_K_ref``: ``make_q3_quants(16, 4, ...)`` per sub-block, the 16 scales to 6 bits
    against the first of largest magnitude, then the levels again from those; the levels' high bit in
    ``hmask`` (bit j // 32 of byte j % 32), the low two in ``qs``."""
    n = x.shape[0]
    sub = x.reshape(n * 16, 16).t().contiguous()
    scales, L = _make_q3(sub, 4, check)
    scales, L = scales.view(n, 16), L.t().reshape(n, 16, 16)
    _, max_scale = _first_absmax(scales)
    live = (max_scale != 0)[:, None]  # the C's if (max_scale)
    iscale = _over(-32.0, max_scale)
    sc = ((nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
    sc = torch.where(live, sc.clamp(-32, 31) + 32, torch.zeros_like(sc))  # 0..63 (memset 0 where not live)
    low, high = sc & 0xF, sc >> 4
    packed = torch.cat([low[:, :8] | (low[:, 8:] << 4), (high.view(n, 4, 4) << (2 * torch.arange(4).view(1, 4, 1))).sum(1)], dim=1)
    d_bits = fp16_bits(torch.where(live[:, 0], _over(1.0, iscale), 0.0))
    d = fp16_value(d_bits)[:, None] * (sc - 32).float()  # the stored scale back: sc - 32
    requant = nearest_int_(torch.div(x.view(n, 16, 16), d[..., None])).clamp_(-4, 3).add_(4)
    L = _select((d != 0)[..., None], requant, L).reshape(n, 256)
    top = L > 3
    hmask = (top.view(n, 8, 32).to(torch.int32) << torch.arange(8).view(1, 8, 1)).sum(1)
    L = torch.where(top, L - 4, L)
    return torch.cat([hmask.to(torch.uint8), _pack_2bit(L).to(torch.uint8), packed.to(torch.uint8), le16(d_bits)], dim=1)
