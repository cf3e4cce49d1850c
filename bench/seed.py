"""``python -m bench seed --out DIR``: the seed's own scenario on the CPU: the shipped ``llama3-8b_qlora`` config on a
synthetic Llama-3-8B (real shapes, random bf16 written once under ``--out``, byte-level tokenizer), a dozen short text
rows, ``training.max_steps=1`` and its default checkpoint settings (the merged save at the run's last step), in a
child process (``bench.colab_child``). Prints the run's peak RSS (VmHWM of the child's whole life) and the RSS of
each phase (``colab_child.PhaseMemory``: load, the step, evaluation and ``eval_loss_merged``, the save's parts).
``--eval-fraction F`` holds out that share of the rows, so evaluation (and ``eval_loss_merged``) runs before
the save. Needs ~9 GB: run it under ``flock /tmp/slimtune-bigmem.lock`` on a shared machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import child_env, synthetic_train_base
from bench.gpu_check import _text_rows


def bench_seed(out: Path, rows: int = 12, words: int = 24, eval_fraction: float = 0.0, layers: int | None = None) -> dict:
    """The run's figures (module docstring) as one JSON-able row.

    Example: ``bench_seed(Path("bench-out"), layers=2)``"""
    out.mkdir(parents=True, exist_ok=True)
    base = synthetic_train_base(out, "llama3-8b", layers)
    data = _text_rows(out / f"seed-{rows}x{words}.jsonl", rows=rows, words=words)
    run_dir = out / "seed-run"
    overrides = [f"output_dir={run_dir}", "overwrite=true", f"model.path={base}", f"dataset.path={data}", "device=cpu"]
    overrides += ["training.max_steps=1", "logging.progress_bar=false"]
    if eval_fraction:
        overrides.append(f"dataset.eval_fraction={eval_fraction}")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "bench.colab_child", *overrides], stdout=subprocess.PIPE, text=True, env=child_env())
    wall = time.perf_counter() - t0
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    shutil.rmtree(run_dir, ignore_errors=True)
    if child.returncode or not lines:
        sys.stdout.write(child.stdout[-4000:])
        raise SystemExit(f"bench seed: the recipe exited {child.returncode}")
    stats = json.loads(lines[-1][len("RESULT ") :])
    shape = "llama3-8b" + (f"[{layers} layers]" if layers else "")
    row = {"bench": "seed", "config": "llama3-8b_qlora", "shape": shape, "rows": rows, "words": words, "eval_fraction": eval_fraction}
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    row |= {**stats, "wall_s_loaded": round(wall, 1), "load_average_1min_before_after": load}
    return row
