"""quant/nf4_kernel.py: the C loop that dequantizes bf16 NF4 weights, against torchao's bits and torch's ops;
where it cannot run, torch's ops with the same bits."""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys

import pytest
import torch

from slimtune import native
from slimtune.quant import nf4_kernel
from slimtune.quant.nf4 import dequantize_nf4_rows, nf4_from_parts, quantize_nf4

from .conftest import ROOT

X86 = platform.machine() in ("x86_64", "AMD64")
LOOPS = list(range(nf4_kernel._library()[1] + 1)) if nf4_kernel._library()[0] is not None else []


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _torch_rows(w, start: int, end: int, monkeypatch) -> torch.Tensor:
    """The same rows through torch's ops (the C loop switched off in this call)."""
    with monkeypatch.context() as m:
        m.setattr("slimtune.quant.nf4.dequantize_bf16", lambda *a, **k: None)
        return dequantize_nf4_rows(w, start, end)


def _loop_rows(w, start: int, end: int, loop: int) -> torch.Tensor:
    cols = w.shape[1]
    e0, e1 = start * cols, end * cols
    b0, b1 = e0 // 64, -(-e1 // 64)
    flat = nf4_kernel.dequantize_bf16(w, b0, b1, loop=loop)
    assert flat is not None
    return flat[e0 - b0 * 64 : e1 - b0 * 64].view(end - start, cols)


def test_the_c_loop_is_built_and_chosen_where_a_compiler_and_a_vector_unit_are():
    """On x86-64 with a C compiler (every machine the suite runs on) the C loop runs, not torch's ops:
    a failed build must not pass silently as the fallback."""
    if X86 and native._compiler() is not None and os.environ.get("SLIMTUNE_NATIVE", "1") != "0":
        assert nf4_kernel.kind() >= 1, nf4_kernel.status()
        assert nf4_kernel.status().startswith("C, "), nf4_kernel.status()
        w = quantize_nf4(torch.randn(64, 128).to(torch.bfloat16))
        assert nf4_kernel.dequantize_bf16(w, 0, 128) is not None
    else:
        assert nf4_kernel.kind() == -1 and nf4_kernel.status().startswith("torch's ops"), nf4_kernel.status()


def _weights():
    gen = torch.Generator().manual_seed(11)
    shapes = [(1536, 576), (192, 576), (576, 576), (1024, 48), (257, 64), (64, 64), (100, 96), (5, 192), (320, 960)]
    for shape in shapes:
        base = torch.randn(shape, generator=gen)
        rows = torch.rand(shape[0], 1, generator=gen)
        yield f"{shape} random", base.mul(0.05)
        yield f"{shape} row scales 1e-3..1e3", base * (10.0 ** (rows * 6 - 3))
        yield f"{shape} tiny (subnormal-scale blocks)", base.mul(1e-38)
        yield f"{shape} huge", base.mul(1e37)
        zeros = base.clone()
        zeros[: max(1, shape[0] // 4)] = 0.0  # whole zero blocks (absmax 0) beside others
        yield f"{shape} zero rows", zeros
        yield f"{shape} constant", torch.full(shape, -0.75)


@pytest.mark.parametrize("loop", LOOPS, ids=[nf4_kernel.KINDS[k] for k in LOOPS])
def test_every_loop_gives_torchaos_bits_on_every_row_range(loop, monkeypatch):
    """Each loop the CPU has (the plain C one included, which production leaves to torch's ops) equals
    torchao's ``get_original_weight`` and torch's ops bit for bit, on random, wide-ranged, subnormal-scale,
    huge, zero and constant weights, scaler blocks of 1 to 256, and row ranges that start and end
    mid-block."""
    checked = 0
    for name, weight in _weights():
        w = quantize_nf4(weight.to(torch.bfloat16))
        reference = _bits(w.get_original_weight())
        rows = w.shape[0]
        for start, end in {(0, rows), (0, 1), (rows // 3, rows // 2 + 1), (rows - 1, rows), (1, max(2, rows - 1))}:
            got = _loop_rows(w, start, end, loop)
            assert torch.equal(_bits(got), reference[start:end]), (name, start, end)
            assert torch.equal(_bits(got), _bits(_torch_rows(w, start, end, monkeypatch))), (name, start, end)
            checked += 1
    assert checked > 200


def test_dequantize_nf4_rows_takes_the_c_loop_for_bf16_and_torchs_ops_otherwise(monkeypatch):
    calls = []
    made = nf4_kernel.dequantize_bf16
    monkeypatch.setattr("slimtune.quant.nf4.dequantize_bf16", lambda *a, **k: calls.append(a[1:]) or made(*a, **k))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = quantize_nf4(torch.randn(128, 128).to(dtype))
        expected = w.get_original_weight()[2:5].contiguous().view(torch.uint8)
        assert torch.equal(dequantize_nf4_rows(w, 2, 5).contiguous().view(torch.uint8), expected)
        assert (made(w, 0, 4) is not None) == (dtype == torch.bfloat16 and nf4_kernel.kind() >= 1)
    assert calls == [(4, 10)] * 3  # rows 2-5 of 128 columns: blocks 4-9, asked for every dtype


def test_malformed_inner_tensors_are_left_to_torchs_ops_never_read_out_of_bounds():
    """A weight whose arrays are shorter than its blocks, of other dtypes, or not contiguous (hostile saved
    NF4 state) never reaches the C loop: it answers None and torch's ops raise or compute as they do.
    Seeded: 300 random corruptions."""
    good = quantize_nf4(torch.randn(256, 128).to(torch.bfloat16))
    parts = {"quantized_data": good.quantized_data, "quantized_scalers": good.quantized_scalers}
    parts |= {"quantization_factor": good.quantization_factor, "scaler_mean": good.scaler_mean}
    rng = random.Random(29)
    for _ in range(300):
        name = rng.choice(sorted(parts))
        broken = dict(parts)
        t = parts[name]
        how = rng.choice(["short", "dtype", "strided"])
        if how == "short" and t.numel() > 1:
            broken[name] = t[: rng.randrange(t.numel())].clone()
        elif how == "dtype":
            broken[name] = t.to(rng.choice([torch.float32, torch.int16, torch.float16]))
        elif t.numel() > 1:
            broken[name] = torch.repeat_interleave(t, 2)[::2]  # same values, stride 2
        else:
            continue
        w = nf4_from_parts((256, 128), torch.bfloat16, **broken)
        assert nf4_kernel.dequantize_bf16(w, 0, 512) is None, (name, how, broken[name].shape, broken[name].dtype)
    assert nf4_kernel.dequantize_bf16(good, 0, 513) is None  # past the weight's last block
    assert nf4_kernel.dequantize_bf16(good, 3, 2) is None


STATUS_SCRIPT = """
import json, os, time
import torch
from slimtune import native
from slimtune.quant import nf4_kernel
from slimtune.quant.nf4 import dequantize_nf4_rows, quantize_nf4
w = quantize_nf4(torch.randn(64, 128).to(torch.bfloat16))
same = torch.equal(dequantize_nf4_rows(w, 0, 64).view(torch.int16), w.get_original_weight().view(torch.int16))
cache = native._cache_dir()
files = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
print(json.dumps({"status": nf4_kernel.status(), "kind": nf4_kernel.kind(), "same": same, "files": files,
                  "mtimes": [os.stat(cache / f).st_mtime_ns for f in files]}))
"""


def _status(tmp_path, **env) -> dict:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    r = subprocess.run([sys.executable, "-c", STATUS_SCRIPT], capture_output=True, text=True, env=full, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not X86 or shutil.which("cc") is None, reason="the C loop is written for x86-64 (here: torch's ops, checked above)")
def test_built_once_into_the_cache_reused_by_the_next_process_and_torchs_ops_without_it(tmp_path):
    first = _status(tmp_path)
    assert first["status"].startswith("C, ") and first["same"], first
    assert len(first["files"]) == 1 and first["files"][0].startswith("nf4_kernel-"), first  # no temporary left
    second = _status(tmp_path)
    assert second["files"] == first["files"] and second["mtimes"] == first["mtimes"], (first, second)  # reused, not rebuilt
    off = _status(tmp_path, SLIMTUNE_NATIVE="0")
    assert off["status"] == "torch's ops (SLIMTUNE_NATIVE=0)" and off["kind"] == -1 and off["same"], off
    broken = _status(tmp_path / "other", CC=shutil.which("false"))
    assert broken["status"].startswith("torch's ops (") and "failed" in broken["status"] and broken["same"], broken
    assert broken["files"] == [], broken  # the failed build's temporary removed
