"""The child of ``python -m bench step-memory``: ``python -m bench.step_memory_child VALUES_JSON`` sets up the
run for the config values given (``recipes.run_steps.prepare``, then the objective's own set-up: for a
preference objective its reference pass, ``PreferenceObjective.setup``), then takes two optimizer steps over one global batch of
every row, and prints one JSON line: RSS before the steps, the steps' peak (VmHWM reset before them), the
reference pass's peak and seconds (VmHWM reset before it), the sequences and non-padding tokens per step."""

from __future__ import annotations

import json
import sys
import time

from slimtune.config import load_config
from slimtune.distributed import SINGLE
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.recipes import finetune
from slimtune.recipes.objectives import objective_for
from slimtune.recipes.run_steps import prepare, restore


def main(argv: list[str]) -> None:
    (values,) = argv
    cfg = load_config("tiny", values=json.loads(values))
    objective = objective_for(cfg)
    run = prepare(cfg, SINGLE, dropped=objective.dropped)
    run.objective = objective
    figures = {"objective": cfg.training.objective, "rss_after_load_mb": rss_mb()}
    sft = cfg.training.objective == "sft"
    reset_peak_rss()
    started = time.perf_counter()
    objective.setup(run)  # SFT: its summary line; a preference objective: the reference pass
    if not sft:
        figures |= {"reference_peak_rss_mb": peak_rss_mb(), "reference_s": time.perf_counter() - started}
    restore(run)
    rows = run.inputs.data.train
    sequences = [r.input_ids for r in rows] if sft else [s.input_ids for p in rows for s in (p.chosen, p.rejected)]
    before = rss_mb()
    reset_peak_rss()
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        finetune.train_step(run, [list(range(len(rows)))])
        seconds.append(time.perf_counter() - started)
    figures |= {"rss_before_steps_mb": before, "steps_peak_rss_mb": peak_rss_mb(), "step_s": seconds}
    figures |= {"sequences_per_step": len(sequences), "tokens_per_step": sum(len(s) for s in sequences)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
