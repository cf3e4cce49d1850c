"""The child of ``python -m bench step-memory`` and ``python -m bench grpo-memory``: ``python -m
bench.step_memory_child VALUES_JSON`` sets up the run for the config values given
(``recipes.run_steps.prepare``, then the objective's own set-up: for a preference objective its reference
pass, ``PreferenceObjective.setup``), then takes training.max_steps optimizer steps, each over one global
batch of every row, and prints one JSON line: RSS after the load and before the steps, the steps' peak
(VmHWM reset before them), the frozen weights' resident MB (``quant.resident_bytes``), the reference pass's
peak and seconds (VmHWM reset before it), the sequences and non-padding tokens per step.

GRPO (``grpo-memory``): each step's generation batch (sampling, rewards, and with beta > 0 the reference
pass) is made by ``prepare_step`` before ``train_step``, which reuses it (num_iterations 1: one batch per
step), so the rollout's peak (``rollout_peak_rss_mb``) is read between the two; the steps' peak covers both."""

from __future__ import annotations

import json
import sys
import time

from slimtune.config import load_config
from slimtune.distributed import SINGLE
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.quant import resident_bytes
from slimtune.recipes import finetune
from slimtune.recipes.objectives import objective_for
from slimtune.recipes.run import Run
from slimtune.recipes.run_steps import prepare, restore


def main(argv: list[str]) -> None:
    (values,) = argv
    cfg = load_config("tiny", values=json.loads(values))
    objective = objective_for(cfg)
    run = prepare(cfg, SINGLE, dropped=objective.dropped)
    run.objective = objective
    frozen = sum(resident_bytes(p) for p in run.model.parameters() if not p.requires_grad) / 2**20
    figures = {"objective": cfg.training.objective, "rss_after_load_mb": rss_mb(), "frozen_weights_mb": frozen}
    reset_peak_rss()
    started = time.perf_counter()
    objective.setup(run)  # SFT: its summary line; a preference objective: the reference pass
    if cfg.training.objective not in ("sft", "grpo"):
        figures |= {"reference_peak_rss_mb": peak_rss_mb(), "reference_s": time.perf_counter() - started}
    restore(run)
    figures |= _steps(run, cfg.training.max_steps)
    print(json.dumps(figures))


def _steps(run: Run, steps: int) -> dict:
    """``steps`` optimizer steps over one batch of every row: RSS before, the peak (and GRPO's rollout peak),
    seconds, sequences and tokens per step."""
    grpo, sft = run.cfg.training.objective == "grpo", run.cfg.training.objective == "sft"
    rows = run.inputs.data.train
    batch = [list(range(len(rows)))]
    before = rss_mb()
    reset_peak_rss()
    figures: dict = {"step_s": []}
    for _ in range(steps):
        started = time.perf_counter()
        if grpo:  # the generation batch, which train_step reuses
            run.objective.prepare_step(run, batch)
            rollout = run.objective.rollout
            figures["rollout_peak_rss_mb"] = peak_rss_mb()
        record = finetune.train_step(run, batch)
        figures["step_s"].append(time.perf_counter() - started)
        if grpo and run.objective.rollout is not rollout:
            raise SystemExit("grpo-memory: train_step sampled a second generation batch (expected it to reuse prepare_step's)")
    figures |= {"rss_before_steps_mb": before, "steps_peak_rss_mb": peak_rss_mb()}
    if grpo:
        figures |= {"sequences_per_step": rollout["counts"]["sequences"], "tokens_per_step": rollout["tokens"]}
        figures["completion_mean_length"] = record["completions/mean_length"]
        figures["generation_tokens_per_s"] = record["generation_tokens_per_s"]
        return figures
    sequences = [r.input_ids for r in rows] if sft else [s.input_ids for p in rows for s in (p.chosen, p.rejected)]
    return figures | {"sequences_per_step": len(sequences), "tokens_per_step": sum(len(s) for s in sequences)}


if __name__ == "__main__":
    main(sys.argv[1:])
