"""slimtune.gguf.kquants and slimtune.gguf.ggml checked block by block against ggml itself:
``ggml_quantize_chunk`` of the libggml that llama-cpp-python loads (the function ``llama_model_quantize``
calls for every tensor; with no importance matrix it runs ``quantize_row_*_ref``), and
``ggml_fp32_to_fp16_row`` for the fp16 rounding. Every block of every type (the K-quants and the legacy
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) must be byte-identical: random rows of several scales, and the edge rows
(zeros, signed zeros, constants, huge and tiny magnitudes up to 3e38, subnormals, outliers, exact ties,
zero sub-blocks); the legacy types equal the ``gguf`` package's numpy quantizers too. The file-level
comparison with ``llama_model_quantize`` is in test_gguf.py.

Every test runs on both paths (``path``): the C loop (``kquant_kernel``, where a compiler is) and torch's
code (``kquants``, ``kquants23``)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from slimtune import native
from slimtune.gguf import ggml, kquant_kernel, kquants
from tests.conftest import llama_cpp_oracle

llama_cpp = llama_cpp_oracle()
_GGML_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.fixture(autouse=True, params=["C", "torch"])
def path(request, monkeypatch):
    """The K-quants' C loop, or torch's code with the loop switched off (forked workers inherit it)."""
    if request.param == "torch":
        monkeypatch.setattr(kquant_kernel, "_library", lambda: (None, "torch (switched off for the test)"))
    elif kquant_kernel.loop_status() != "C":
        # with a compiler (every machine the suite runs on) a failed build must not pass as the fallback
        assert native._compiler() is None or os.environ.get("SLIMTUNE_NATIVE", "1") == "0", kquant_kernel.loop_status()
        pytest.skip(f"no C loop here: {kquant_kernel.loop_status()}")
    return request.param


def _ggml():
    import llama_cpp._ggml  # the binding's own handle on libggml-base

    lib = llama_cpp._ggml.libggml
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.ggml_quantize_chunk.argtypes += [ctypes.c_void_p]
    lib.ggml_fp32_to_fp16_row.restype = None
    lib.ggml_fp32_to_fp16_row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def ggml_quantize(rows: np.ndarray, type_name: str) -> np.ndarray:
    """ggml's own quantization of fp32 rows (no importance matrix), as bytes per block."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros(rows.size // ggml.BLOCK_VALUES[type_name] * ggml.BLOCK_BYTES[type_name], dtype=np.uint8)
    n = _ggml().ggml_quantize_chunk(_GGML_TYPE[type_name], rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], rows.shape[1], None)
    assert n == out.size
    return out.reshape(-1, ggml.BLOCK_BYTES[type_name])


def edge_rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 256

    def randn() -> torch.Tensor:
        return torch.randn(n, generator=g)

    rows = [torch.zeros(n), -torch.zeros(n)]
    rows += [torch.full((n,), c) for c in (1.0, -1.0, 3e-3, -7.5, 65504.0, 1e-30, 1.4e-45)]
    rows += [randn() * s for s in (1e-38, 1e-30, 1e-10, 1e-6, 1e-3, 1.0, 1e3, 1e6, 1e10, 1e20, 1e30, 3e38)]
    rows += [randn() * 1e-39, randn().sign() * 1.4e-45]  # subnormals
    r = randn()
    r[::7] = 0
    rows.append(r)
    r = randn()
    r[5] = 1e4  # one outlier
    rows.append(r)
    rows += [torch.rand(n, generator=g), -torch.rand(n, generator=g)]  # one sign only
    rows += [torch.randint(-8, 8, (n,), generator=g).float() * 0.5, torch.randint(-40, 40, (n,), generator=g).float()]  # ties
    for amax, step in ((127.0, 0.5), (63.5, 0.25)):  # Q8_0's scale exactly 1 and 0.5: levels at exact ties n + 0.5
        r = torch.randint(-int(amax / step), int(amax / step), (n,), generator=g).float() * step
        r[::32] = amax
        rows.append(r)
    r = torch.full((n,), 0.5 - 2.0**-25)  # the float below one half, beside +-0.5 and +-1.5, in blocks of scale 1
    r[1::4], r[2::4], r[3::4] = -0.5, 1.5, -(0.5 - 2.0**-25)
    r[::32] = -127.0
    rows.append(r)
    r = randn()
    r[:32], r[64:80] = 0, 0  # zero sub-blocks in a live block
    rows.append(r)
    r = randn()
    r[:128] *= 1e-8
    rows.append(r)
    r = randn() * 1e-5
    r[200] = 1.0
    rows.append(r)
    rows += [torch.linspace(-1, 1, n), torch.linspace(0, 1e-7, n)]
    rows += [_lanes_apart(randn()), _lanes_apart(randn()).flip(0)]
    r = torch.full((n,), 3.4e38)
    r[::2] = -3.4e38  # spans that overflow to inf
    rows.append(r)
    rows += [randn().exp() * randn().sign(), (randn() * 20).exp2().clamp(max=3e38)]
    return torch.stack(rows)


def _lanes_apart(r: torch.Tensor) -> torch.Tensor:
    """A row whose 16-value groups each take another branch of the scale searches, side by side in the C
    loop's lanes (8 groups at once): constant (max == min: positive, negative, zero), one live value,
    one sign, max == min within a 32-value group only, tiny beside huge, live."""
    r = r.clone()
    r[0:16], r[16:32], r[32:48], r[48:64] = 0.25, -3.0, 0.0, 0.0
    r[52] = -1.0
    r[64:80] = r[64:80].abs()
    r[96:128] = 7.0
    r[128:144] *= 1e-20
    r[144:160] *= 1e20
    r[160:176] = -r[160:176].abs()
    return r


def random_rows(seed: int) -> torch.Tensor:
    """Weight-like rows: Gaussian at several scales, heavy tails, bf16-rounded values (a bf16 checkpoint's rows)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(64, 512, generator=g) * s for s in (0.02, 1.0, 300.0)]
    parts.append(torch.randn(64, 512, generator=g) * torch.randn(64, 512, generator=g).exp())
    parts.append((torch.randn(64, 512, generator=g) * 0.02).bfloat16().float())
    return torch.cat(parts)


def _assert_blocks_equal(rows: torch.Tensor, type_name: str, threads: int | None = None, finite: bool = False) -> None:
    ours = ggml.quantize(rows, type_name, threads, finite).numpy().reshape(-1, ggml.BLOCK_BYTES[type_name])
    with np.errstate(all="ignore"):
        ref = ggml_quantize(rows.numpy(), type_name)
    bad = np.nonzero((ours != ref).any(axis=1))[0]
    assert len(bad) == 0, f"{type_name}: {len(bad)} of {len(ref)} blocks differ from ggml's, first {bad[:8].tolist()}"


def _fp16_safe(rows: torch.Tensor) -> torch.Tensor:
    """The rows whose legacy block scales fit float16 (the others are one error line: test_legacy_overflow)."""
    return rows[rows.abs().amax(1) < 60000]


@pytest.mark.parametrize("type_name", KQUANTS + LEGACY)
def test_random_rows_byte_identical_to_ggml(type_name):
    _assert_blocks_equal(random_rows(0), type_name)


@pytest.mark.parametrize("type_name", KQUANTS + LEGACY)
def test_edge_rows_byte_identical_to_ggml(type_name):
    for seed in range(2):
        rows = edge_rows(seed)
        _assert_blocks_equal(rows if type_name in KQUANTS else _fp16_safe(rows), type_name)


@pytest.mark.parametrize("path", ["torch"], indirect=True)
@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q5_K"])
def test_scale_search_falls_back_to_checked_levels_only_where_needed(type_name, monkeypatch, path):
    """make_qkx2's candidates take the unchecked fast levels and keep their reach: random rows finish in
    that search; edge rows (spans that overflow, 3e38) leave the fast range, so the search runs again with
    every candidate's levels checked, and both give ggml's bytes. (torch's code only: the C has no such paths.)"""
    runs = []
    search = kquants._qkx2_search

    def spy(*args, **kwargs):
        result = search(*args, **kwargs)
        runs.append((kwargs["checked"], result is None))
        return result

    monkeypatch.setattr(kquants, "_qkx2_search", spy)
    _assert_blocks_equal(random_rows(3), type_name, threads=1)
    assert runs and all(r == (False, False) for r in runs)
    runs.clear()
    _assert_blocks_equal(edge_rows(0), type_name, threads=1)
    assert (False, True) in runs and (True, False) in runs


@pytest.mark.parametrize("type_name", KQUANTS + LEGACY)
def test_finite_rows_checked_as_the_export_checks_them_byte_identical_to_ggml(type_name):
    """``finite=True`` (the export's call: NaN and infinities refused, so Q8_0 takes torch's fp16 cast of
    its scales straight): on the finite rows, ggml's bytes as well."""
    rows = torch.cat([random_rows(5)[:, :256], *(edge_rows(seed) for seed in range(2))])
    rows = rows[torch.isfinite(rows).all(1)]
    _assert_blocks_equal(rows if type_name in KQUANTS else _fp16_safe(rows), type_name, finite=True)


@pytest.mark.parametrize("path", ["C"], indirect=True)
@pytest.mark.parametrize("type_name", KQUANTS + LEGACY)
def test_c_baseline_lanes_byte_identical_to_ggml(path, monkeypatch, type_name):
    """The C loop built without its AVX2 code (``-DSLIMTUNE_BASELINE_ONLY``: what a CPU without AVX2 runs,
    its comparisons in pieces of 4 lanes): random and edge rows give ggml's bytes."""
    baseline = kquant_kernel._load(kquant_kernel.FLAGS + ("-DSLIMTUNE_BASELINE_ONLY",))
    assert baseline[0] is not None, baseline[1]
    monkeypatch.setattr(kquant_kernel, "_library", lambda: baseline)
    rows = torch.cat([random_rows(1)[:, :256], edge_rows(0)])
    _assert_blocks_equal(rows if type_name in KQUANTS else _fp16_safe(rows), type_name, threads=1)


@pytest.mark.parametrize("path", ["C"], indirect=True)
def test_c_q8_0_blocks_with_nan_are_ggmls(path):
    """ggml's running max |x| starts again after a NaN (the comparison is false): the C loop's Q8_0 of a
    block holding one, not last, is ggml's bytes (torch's code takes the block's max, NaN: an overflow)."""
    rows = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    rows[0, 0], rows[1, 37], rows[2, 64 + 30], rows[3, 96 + 15] = float("nan"), float("nan"), float("nan"), float("nan")
    rows[3, 96 + 3] = 50.0  # before the NaN: not the block's max in ggml's fold
    _assert_blocks_equal(rows, "Q8_0", threads=1)


@pytest.mark.parametrize("type_name", LEGACY)
def test_legacy_types_equal_the_gguf_package(type_name):
    """slimtune equals the gguf package's numpy quantizers on every block where the package equals ggml.
    They differ on one kind here: a Q4_0/Q5_0 block of -0.0 only, whose scale is -0.0 in ggml (its max
    starts at +0.0 and never moves) and +0.0 in the package (slimtune writes ggml's, checked above)."""
    import gguf

    rows = torch.cat([random_rows(1)[:, :256], _fp16_safe(edge_rows(2))])
    size = ggml.BLOCK_BYTES[type_name]
    ours = ggml.quantize(rows, type_name).numpy().reshape(-1, size)
    with np.errstate(all="ignore"):
        theirs = gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType[type_name]).reshape(-1, size)
        ref = ggml_quantize(rows.numpy(), type_name)
    agree = (theirs == ref).all(axis=1)
    negative_zero = (rows.reshape(-1, 32) == 0).all(1).numpy() & torch.signbit(rows.reshape(-1, 32)).all(1).numpy()
    assert np.array_equal(~agree, negative_zero & (type_name in ("Q4_0", "Q5_0")))
    assert np.array_equal(ours[agree], theirs[agree]) and np.array_equal(ours, ref)


def test_threads_and_pieces_do_not_change_the_bytes(monkeypatch):
    """Many pieces (4 blocks each here) on two threads: the same blocks, in order, as one thread, and ggml's."""
    monkeypatch.setattr(ggml, "_TYPES", {k: (fn, values, 4) for k, (fn, values, _) in ggml._TYPES.items()})
    rows = random_rows(3)[::20, :1024]  # 16 rows: 64 superblocks, 512 legacy blocks
    for type_name in ("Q8_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"):
        one, two = ggml.quantize(rows, type_name, threads=1), ggml.quantize(rows, type_name, threads=2)
        assert torch.equal(one, two)
        _assert_blocks_equal(rows, type_name, threads=2)


def test_16_bit_rows_are_their_float32_values():
    """bf16 and fp16 rows (a stored tensor, widened a piece at a time) give the bytes of their float32 values."""
    rows = random_rows(4)[::16]
    for type_name in KQUANTS + LEGACY:
        for dtype in (torch.bfloat16, torch.float16):
            narrow = rows.clamp(-60000, 60000).to(dtype)
            assert torch.equal(ggml.quantize(narrow, type_name, threads=2), ggml.quantize(narrow.float(), type_name, threads=1))


def test_non_finite_is_an_error_when_asked():
    """``finite=True``: a NaN or an infinity anywhere in a row (any block, any position) is a NonFiniteError
    (the export's one line), found from the blocks' own maxima and minima; by default a K-quant writes
    ggml's bytes for them (test_edge_rows_byte_identical_to_ggml) and a legacy type's scale overflows."""
    for type_name in KQUANTS + LEGACY:
        for bad in (float("nan"), float("inf"), float("-inf")):
            for where in (0, 300, 511):
                rows = torch.randn(3, 512) * 0.02
                rows[1, where] = bad
                with pytest.raises(ggml.NonFiniteError):
                    ggml.quantize(rows, type_name, finite=True)
                ggml.quantize(rows[:1], type_name, finite=True)  # the finite row alone passes
    for type_name in KQUANTS:
        assert ggml.quantize(torch.full((1, 256), float("inf")), type_name).numel() == ggml.BLOCK_BYTES[type_name]


def test_legacy_overflow():
    """A block scale beyond float16 is a FloatingPointError (the export's one line), not an inf in the file."""
    for type_name in LEGACY:
        for finite in (False, True):
            with pytest.raises(FloatingPointError):
                ggml.quantize(torch.full((1, 32), 3e38), type_name, finite=finite)


def test_fp16_rounding_is_ggmls():
    """fp16_bits equals ggml_fp32_to_fp16_row on float32 bit patterns of every exponent (subnormal
    results, ties, overflow to inf, NaN included)."""
    g = np.random.default_rng(0)
    bits = g.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(-40, 20, dtype=np.int64)[:, None] + 127 << 23 | np.array([0x1000, 0x3000, 0x0FFF, 0x1001])).reshape(-1)
    x = np.concatenate([bits.view(np.float32), ties.astype(np.uint32).view(np.float32), np.float32([0.0, -0.0, 65504, 65520, 1e-8])])
    ref = np.zeros(x.size, dtype=np.uint16)
    _ggml().ggml_fp32_to_fp16_row(x.ctypes.data, ref.ctypes.data, x.size)
    ours = kquants.fp16_bits(torch.from_numpy(x)).numpy().astype(np.uint16)
    assert np.array_equal(ours, ref)


def test_nearest_int_is_ggmls():
    """Round half to even inside ggml's range (|v| <= 2**22); ggml's exact values outside it (inf -> -2**22, NaN -> 0)."""
    v = torch.cat([torch.arange(-40, 40) * 0.5, torch.randn(10000) * 1000, torch.tensor([4194303.0, -4194303.0])])
    assert torch.equal(kquants.nearest_int(v), torch.round(v).int())
    special = kquants.nearest_int(torch.tensor([float("inf"), float("-inf"), float("nan")]))
    assert special.tolist() == [-(2**22), -(2**22), 0]


def test_sqrtf_is_correctly_rounded_where_torch_is_not():
    """The trap behind the one differing block found on a real export: torch's float32 sqrt is off by an
    ulp on some inputs here; kquants' sqrtf equals C's (numpy's) on every one."""
    x = np.abs(np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)) * 1e-3
    assert np.array_equal(kquants._sqrtf(torch.from_numpy(x)).numpy(), np.sqrt(x))


def test_running_sum_is_sequential():
    """C's ``s += t`` order: different from a pairwise reduction on rows chosen so the two round apart."""
    t = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24] * 4).view(-1, 1)
    s = 0.0
    for v in t[:, 0].tolist():
        s = float(np.float32(s + v))
    assert kquants._running_sum(t).item() == s and s != float(t.sum(dtype=torch.float64))


@pytest.mark.parametrize("n", [16, 31, 32])
def test_running_sum_equals_the_c_loop_on_wide_sums(n):
    """Every sum of wide-range terms (magnitudes 1e-3..1e3 in shuffled order), with and without a start,
    equals numpy's float32 ``s += t`` loop bit for bit, while the float64 sum rounded once and the reversed
    order round most of them differently (so the comparison can tell the orders apart)."""
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, 3, 512, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)][:, None, None]
    start = torch.randn(3, 512, generator=g)
    for first in (None, start):
        acc = np.zeros((3, 512), np.float32) if first is None else first.numpy().copy()
        for row in t.numpy():
            acc = (acc + row).astype(np.float32)
        got = kquants._running_sum(t, first)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.int32), acc.view(np.int32))
    base = kquants._running_sum(t).view(torch.int32)
    assert (t.double().sum(0).float().view(torch.int32) != base).float().mean() > 0.3
    assert (kquants._running_sum(t.flip(0)).view(torch.int32) != base).float().mean() > 0.3


def test_bad_input():
    with pytest.raises(ValueError, match="blocks of 256"):
        ggml.quantize(torch.zeros(2, 320), "Q4_K")
    with pytest.raises(ValueError, match="blocks of 32"):
        ggml.quantize(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(ValueError, match="IQ4_NL"):
        ggml.quantize(torch.zeros(2, 256), "IQ4_NL")
    assert ggml.quantize(torch.zeros(0, 256), "Q6_K").numel() == 0


def test_the_c_loop_runs_where_it_is_built(path, monkeypatch):
    """``ggml.quantize`` runs the C loop for the K-quants and Q4_0 ... Q8_0 where it is built (the ``path`` fixture fails
    where a compiler is and the build is not), torch's code where it is switched off."""
    calls = []
    real = kquant_kernel.quantize_blocks
    monkeypatch.setattr(kquant_kernel, "quantize_blocks", lambda *a: calls.append(a[1]) or real(*a))
    for type_name in KQUANTS + LEGACY:
        ggml.quantize(torch.randn(2, 512), type_name, threads=1)
    assert calls == (KQUANTS + LEGACY if path == "C" else [])
    assert kquant_kernel.loop_status() == "C" if path == "C" else kquant_kernel.loop_status().startswith("torch (")


def test_the_c_loop_quantizes_on_threads_and_torch_on_forked_workers(path):
    """A type the C loop quantizes goes to threads of this process (nothing forked, no shared-memory copy);
    one torch quantizes goes to the forked pool (two torch threads would wait on each other's GIL)."""
    rows = random_rows(5)[:8, :2048]
    with ggml.Quantizer(2) as q:
        assert torch.equal(q.submit(rows, "Q4_K")(), ggml.quantize(rows, "Q4_K", threads=1))
        assert (q._pool is None) == (path == "C") and (q._lanes is not None) == (path == "C")


def test_bf16_pieces_on_threads_are_their_float32_values_and_their_check(path):
    """bf16 rows on the quantizer's threads (the C loop widens each block itself; torch's workers widen the
    piece) give the bytes of their float32 values, for every type; with ``finite`` a NaN or an infinity
    anywhere is a NonFiniteError, and a legacy scale's float16 overflow a FloatingPointError."""
    rows = random_rows(6)[::8].clamp(-60000, 60000).bfloat16()  # 40 rows of 512
    with ggml.Quantizer(2) as q:
        for type_name in KQUANTS + LEGACY:
            assert torch.equal(q.submit(rows, type_name, finite=True)(), ggml.quantize(rows.float(), type_name, threads=1)), type_name
        for bad in (float("nan"), float("inf")):
            hit = rows.clone()
            hit[17, 300] = bad
            for type_name in ("Q4_K", "Q8_0"):
                with pytest.raises(ggml.NonFiniteError):
                    q.submit(hit, type_name, finite=True)()
        with pytest.raises(FloatingPointError):
            q.submit(torch.full((1, 32), 3e38).bfloat16(), "Q4_0")()


@pytest.mark.parametrize("path", ["C"], indirect=True)
def test_c_fp16_rounding_is_ggmls(path):
    """The C loop's fp32 -> fp16 (its block scales) equals ggml_fp32_to_fp16_row on bit patterns of every
    exponent: subnormal results, ties, overflow to inf, NaN."""
    g = np.random.default_rng(2)
    bits = g.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(-40, 20, dtype=np.int64)[:, None] + 127 << 23 | np.array([0x1000, 0x3000, 0x0FFF, 0x1001])).reshape(-1)
    x = np.concatenate([bits.view(np.float32), ties.astype(np.uint32).view(np.float32), np.float32([0.0, -0.0, 65504, 65520, 1e-8])])
    ref = np.zeros(x.size, dtype=np.uint16)
    _ggml().ggml_fp32_to_fp16_row(x.ctypes.data, ref.ctypes.data, x.size)
    assert np.array_equal(kquant_kernel.c_fp16_bits(torch.from_numpy(x)).numpy().astype(np.uint16), ref)


@pytest.mark.parametrize("path", ["C"], indirect=True)
@pytest.mark.parametrize("build", ["native", "baseline"])
@pytest.mark.parametrize("type_name", LEGACY)
def test_c_legacy_blocks_of_every_bf16_bit_pattern_are_ggmls(path, build, type_name):
    """The 32-value types of bf16 blocks (widened by the C loop; Q8_0 in registers, the export's path for a
    stored tensor) equal ggml's quantization of their float32 values, over every bf16 bit pattern:
    subnormals, huge values whose scale overflows float16, zeros of either sign, NaN and infinities
    (without the check), and blocks of one magnitude; with the AVX2 lane code where the CPU has it, and
    built without it."""
    g = np.random.default_rng(3)
    bits = np.concatenate([g.permutation(np.arange(1 << 16, dtype=np.uint32)) for _ in range(2)])
    scales = g.integers(0x3000, 0x4000, bits.size // 32, dtype=np.uint32)  # blocks of one magnitude too
    same = (scales[:, None] + g.integers(-64, 64, (scales.size, 32))).astype(np.uint32) | (g.integers(0, 2, (scales.size, 32)) << 15)
    bits = np.concatenate([bits, same.reshape(-1)]).astype(np.uint16)
    x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(-1, 32)
    flags = kquant_kernel.FLAGS + (("-DSLIMTUNE_BASELINE_ONLY",) if build == "baseline" else ())
    lib = kquant_kernel._load(flags)[0]
    code, size, _ = kquant_kernel.TYPES[type_name]
    ours = torch.empty(x.shape[0], size, dtype=torch.uint8)
    lib.slimtune_kquant_bf16(code, x.data_ptr(), ours.data_ptr(), x.shape[0], 0)
    with np.errstate(all="ignore"):
        ref = ggml_quantize(x.float().numpy(), type_name)
    bad = np.nonzero((ours.numpy() != ref).any(axis=1))[0]
    assert len(bad) == 0, f"{type_name}: {len(bad)} of {len(ref)} blocks differ from ggml's, first {bad[:8].tolist()}"
