"""slimtune.gguf.pool: the forked workers the quantizer runs on. Their bytes equal the in-thread
quantizer's (tests/test_kquants.py compares threads=1 and threads=2 too); here: errors come back as
themselves, a dead worker is one error (no hang), slots are reused in order, and the workers end with
the pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from slimtune.errors import SlimtuneError
from slimtune.gguf import ggml
from slimtune.gguf.pool import PiecePool, can_fork
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not can_fork(), reason="the pool forks (Linux)")


@pytest.fixture(autouse=True)
def _deadline():
    """A pool that hangs fails the test instead of the suite."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the pool hung"))
    signal.alarm(120)
    yield
    signal.alarm(0)


def _rows(blocks: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(blocks, 256, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_many_submissions_in_flight_reuse_the_slots_in_order():
    rows = [_rows(700, seed) for seed in range(7)]  # more submissions than slots, each several pieces
    expected = [ggml.quantize(r, "Q4_K", threads=1) for r in rows]
    with ggml.Quantizer(2) as q:
        waits = [q.submit(r, "Q4_K") for r in rows]  # nothing waited yet: the oldest are finished to free slots
        got = [w() for w in waits]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_nonfinite_row_comes_back_as_its_error_and_the_pool_goes_on():
    bad = _rows(2100)
    bad[1500, 7] = float("nan")
    with ggml.Quantizer(2) as q:
        with pytest.raises(ggml.NonFiniteError):
            q.submit(bad, "Q4_K", finite=True)()
        good = _rows(2100, 1)
        assert torch.equal(q.submit(good, "Q4_K", finite=True)(), ggml.quantize(good, "Q4_K", threads=1))


def test_a_float16_overflow_comes_back_as_floatingpointerror():
    rows = torch.full((4096 * 2, 32), 1e30)  # Q4_0's scale overflows float16
    with pytest.raises(FloatingPointError):
        ggml.quantize(rows, "Q4_0", threads=2)


def _killer(name: str, piece: torch.Tensor, finite: bool) -> torch.Tensor:
    if piece[0, 0] < 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return piece.sum(1)


def test_a_worker_killed_mid_piece_is_one_error_naming_it():
    rows = torch.ones(8, 4)
    rows[6:] = -1  # the last piece kills its worker
    with pytest.raises(SlimtuneError, match=r"quantizer process \d+ ended \(killed by SIGKILL; out of memory\?\)"):
        with PiecePool(_killer, 2, 1024) as pool:
            pool.submit(rows, [(0, 2), (2, 4), (4, 6), (6, 8)], "sum", [8, 8, 8, 8], False)()


def test_the_workers_end_with_the_pool():
    with PiecePool(lambda name, piece, finite: piece.sum(1), 2, 1024) as pool:
        procs = list(pool._procs)
        assert [p.is_alive() for p in procs] == [True, True]
        parts = pool.submit(torch.arange(16.0).view(4, 4), [(0, 2), (2, 4)], "sum", [8, 8], False)()
    assert [p.view(torch.float32).tolist() for p in parts] == [[6.0, 22.0], [38.0, 54.0]]
    assert [p.exitcode for p in procs] == [0, 0]


def test_rows_larger_than_a_slot_go_in_several():
    rows = _rows(20000)  # 20 MB of float32: two slots' worth
    assert torch.equal(ggml.quantize(rows, "Q4_K", threads=2), ggml.quantize(rows, "Q4_K", threads=1))


_PARENT = """
import os, sys, time
import torch
from slimtune.gguf.pool import PiecePool

with PiecePool(lambda name, piece, finite: piece.sum(1), 2, 1024) as pool:
    print(" ".join(str(p.pid) for p in pool._procs), flush=True)
    time.sleep(600)
"""


def test_the_workers_end_when_their_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert len(workers) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False
