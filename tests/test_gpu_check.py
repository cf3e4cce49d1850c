"""bench/gpu_check.sh --cpu-smoke: the GPU script's dry run on the CPU with tiny shapes, every step of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_gpu_check_cpu_smoke_runs_every_step():
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [row for row in rows if "step" in row]
    assert len(steps) == 4 and all(row["rc"] == 0 for row in steps), steps
    colab = next(row for row in rows if row.get("check") == "colab-tiny")
    assert colab["steps"] == 2 and colab["save_bytes"] > 0 and colab["host_peak_rss_mb"] > 0 and colab["save_ratio"] > 0
    train = {row["variant"]: row for row in rows if row.get("check") == "train"}
    assert set(train) == {"slimtune-eager", "slimtune-compiled", "peft-bnb-qlora", "peft-bf16-lora"}
    assert train["slimtune-eager"]["tok_s"] > 0 and train["peft-bf16-lora"]["tok_s"] > 0
    assert "tok_s" in train["peft-bnb-qlora"] or "bitsandbytes" in train["peft-bnb-qlora"]["skipped"]
    assert not any("error" in row for row in rows), rows
    assert sum(1 for row in rows if "ratio" in row and "preset" in row) == 2  # the save and merge benches
