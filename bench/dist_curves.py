"""How closely 2 FSDP2 ranks follow 1 process, and what resuming on another number of ranks costs.

Runs the tiny config through the recipe (``slimtune finetune --nproc N``) for STEPS steps with a
checkpoint every STEPS // 2, in the given dtype: 1 rank; 2 ranks; 2 ranks stopped halfway and resumed
on 2, on 1; 1 rank stopped halfway and resumed on 2. Prints one JSON line: the largest absolute and
relative loss difference of each run against its reference, and whether the 2 -> 2 resume is
bit-identical (losses and adapter file).

Usage: python bench/dist_curves.py [--dtype bf16|fp32] [--steps 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(out: Path, nproc: int, steps: int, dtype: str, *extra: str) -> None:
    args = ["finetune", "--config", "tiny", "--nproc", str(nproc), f"output_dir={out}", f"dtype={dtype}", "logging.progress_bar=false"]
    args += [f"training.max_steps={steps}", f"checkpoint.save_every_n_steps={steps // 2}", "checkpoint.keep_last_n=10", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "slimtune", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{out.name}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _diff(a: list[float], b: list[float]) -> dict:
    assert len(a) == len(b)
    return {
        "max_abs": max(abs(x - y) for x, y in zip(a, b, strict=True)),
        "max_rel": max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="slimtune-dist-curves-"))
    half = f"training.stop_after_steps={args.steps // 2}"
    one, two = root / "one", root / "two"
    _train(one, 1, args.steps, args.dtype)
    _train(two, 2, args.steps, args.dtype)
    _train(root / "two-half", 2, args.steps, args.dtype, half)
    _train(root / "one-half", 1, args.steps, args.dtype, half)
    results = {}
    for name, src, nproc, reference in (("2->2", "two-half", 2, two), ("2->1", "two-half", 1, two), ("1->2", "one-half", 2, one)):
        run = root / f"resume-{name.replace('->', '-')}"
        shutil.copytree(root / src, run)
        _train(run, nproc, args.steps, args.dtype, "resume=true")
        results[name] = {"against": reference.name, **_diff(_losses(reference), _losses(run))}
    final = f"step-{args.steps:06d}/adapter/adapter_model.safetensors"
    same = _losses(two) == _losses(root / "resume-2-2") and (two / final).read_bytes() == (root / "resume-2-2" / final).read_bytes()
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "steps": args.steps,
                "one_vs_two": _diff(_losses(one), _losses(two)),
                "resume": results,
                "resume_2_to_2_bit_identical": same,
            }
        )
    )
    if args.out is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
