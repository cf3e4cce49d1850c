"""The one training loop (recipes/finetune.py with recipes/train_loop.py) and its named interface, the
``Objective`` (recipes/objective.py): an objective registered by name runs through the whole loop (its
micro-batches, figure sums, step metrics, evaluation, merged figure and progress bar figures); the
non-finite-loss check stops any objective in one line; the no-grad pass leaves training as it was."""

from __future__ import annotations

import json

import pytest
import torch

from slimtune.config import load_config
from slimtune.errors import SlimtuneError
from slimtune.recipes.finetune import run_finetune, setup
from slimtune.recipes.objectives import OBJECTIVES
from slimtune.recipes.objectives.sft import SupervisedObjective
from slimtune.recipes.run_steps import restore
from slimtune.recipes.train_loop import no_grad_batches


def _config(tiny_base, tmp_path, *extra: str):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}: the cat sat on the mat {i}"}) + "\n" for i in range(16)))
    return load_config(
        "tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={tiny_base}",
            f"dataset.path={data}",
            "dataset.eval_fraction=0.25",
            "dataset.shuffle=false",
            "training.batch_size=2",
            "training.gradient_accumulation_steps=2",
            "training.max_steps=3",
            "checkpoint.save_every_n_steps=2",
            "checkpoint.async=false",
            "logging.progress_bar=false",
            *extra,
        ],
    )


class CountingObjective(SupervisedObjective):
    """SFT's loss, plus two figure sums per micro-batch (one, its rows) and its own step, eval and bar figures."""

    merged_metric = "eval_rows"
    shown: list = []

    def micro_batch_loss(self, model, inputs, step):
        loss, _ = super().micro_batch_loss(model, inputs, step)
        return loss, torch.tensor([1.0, float(inputs["input_ids"].shape[0])], device=loss.device)

    def step_metrics(self, sums, step):
        return {"micro_batches": float(sums[0]), "rows": float(sums[1])}

    def evaluate(self, run):
        rows = sum(int(b["input_ids"].shape[0]) for b, _ in no_grad_batches(run, run.inputs.data.eval, self.collate))
        return {**super().evaluate(run), "eval_rows": rows}

    def figures(self, run):
        self.shown.append(run.record["rows"])
        return {"rows": f"{run.record['rows']:.0f}"}


def test_an_objective_registered_by_name_runs_in_the_one_loop(tiny_base, tmp_path, monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "sft", CountingObjective)
    CountingObjective.shown = []
    seen = []
    result = run_finetune(_config(tiny_base, tmp_path), on_step=seen.append)
    assert [r["step"] for r in seen] == [1, 2, 3]
    assert all(r["micro_batches"] == 2 and r["rows"] == 4 for r in seen)  # summed over the step's micro-batches
    assert CountingObjective.shown == [4, 4, 4]  # the progress bar's figures, once per step
    evaluated = [r for r in seen if "eval_rows" in r]
    assert [r["step"] for r in evaluated] == [2, 3] and all(r["eval_rows"] == 4 for r in evaluated)  # 16 rows, a quarter held out
    assert all(r["eval_rows_merged"] == 4 for r in evaluated)  # the merged_metric again, through the merged model
    assert result.global_step == 3


def test_a_non_finite_loss_stops_any_objective_in_one_line(tiny_base, tmp_path, monkeypatch):
    class NanObjective(SupervisedObjective):
        def micro_batch_loss(self, model, inputs, step):
            loss, sums = super().micro_batch_loss(model, inputs, step)
            return loss * float("nan"), sums

    monkeypatch.setitem(OBJECTIVES, "sft", NanObjective)
    with pytest.raises(SlimtuneError, match=r"^the loss is nan at step 1; lower optimizer.lr or check the data$"):
        run_finetune(_config(tiny_base, tmp_path))
    assert not (tmp_path / "run").exists()  # a fresh run that failed leaves nothing behind


def test_the_no_grad_pass_leaves_training_as_it_was(tiny_base, tmp_path):
    run = setup(_config(tiny_base, tmp_path))
    restore(run)
    run.model.train()
    rng = torch.get_rng_state()
    inside = []
    for batch, indices in no_grad_batches(run, run.inputs.data.eval, run.objective.collate):
        torch.rand(3)  # draws inside the pass do not move training's RNG
        inside.append((torch.is_grad_enabled(), run.model.training, len(indices), batch["input_ids"].device.type))
    assert inside == [(False, False, 2, run.where.device.type)] * 2
    assert run.model.training and torch.is_grad_enabled() and torch.equal(torch.get_rng_state(), rng)
    run.sinks.bar.close()
