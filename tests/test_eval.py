"""Held-out evaluation in the recipe: eval loss at the configured steps and at checkpoints, resume stays
bit-exact with evaluation on, the plot and the optional TensorBoard/W&B sinks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slimtune.cli import main

ROWS = [{"text": f"sentence number {i} about checkpoints and memory"} for i in range(12)]


@pytest.fixture(scope="module")
def eval_settings(tiny_base, tmp_path_factory) -> list[str]:
    """12 rows, 3 held out (seeded), batch 3: 3 steps per epoch, 2 epochs; dropout on so RNG matters."""
    path = tmp_path_factory.mktemp("evaldata") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return [
        f"model.path={tiny_base}",
        "model.create_tiny=false",
        f"dataset.path={path}",
        "dataset.create_builtin=false",
        "dataset.eval_fraction=0.25",
        "training.batch_size=3",
        "training.total_epochs=2",
        "training.eval_every_n_steps=2",
        "lora.dropout=0.1",
        "checkpoint.save_every_n_steps=3",
        "checkpoint.keep_last_n=null",
        "checkpoint.merged=never",
        "training.sample_prompts=[Checkpoints are]",
        "training.sample_max_new_tokens=4",
        "logging.progress_bar=false",
    ]


def finetune(capsys, out: Path, settings: list[str], *extra: str) -> str:
    code = main(["finetune", "--config", "tiny", f"output_dir={out}", *settings, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    return captured.out


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_eval_at_configured_steps_and_checkpoints_and_exact_resume(tmp_path, eval_settings, capsys):
    straight = tmp_path / "straight"
    log = finetune(capsys, straight, eval_settings, "logging.tensorboard=true")
    rows = metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 3, 4, 6]  # every 2 steps and at checkpoints 3 and 6
    for r in rows:
        if "eval_loss" in r:
            assert math.isclose(r["eval_ppl"], math.exp(r["eval_loss"])) and r["eval_tokens"] > 0
    assert "9 examples, 3 held out" in log and "eval loss" in log
    assert list((straight / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard event files written when enabled

    resumed = tmp_path / "resumed"
    finetune(capsys, resumed, eval_settings, "training.stop_after_steps=3")
    out = finetune(capsys, resumed, eval_settings, "resume=true")
    assert "resumed from step-000003" in out
    again = metrics(resumed)
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]  # bit-identical training with eval on
    assert [r.get("eval_loss") for r in again] == [r.get("eval_loss") for r in rows]
    assert [r.get("samples") for r in again] == [r.get("samples") for r in rows]  # sampling at checkpoints changes nothing either
    assert [r["step"] for r in rows if "samples" in r] == [3, 6] and rows[2]["samples"][0]["prompt"] == "Checkpoints are"
    assert again[3]["resumed_from"] == 3 and "resumed_from" not in rows[3]

    # an adapter-only checkpoint: generate takes the adapter on the NF4 base, with the tokenizer saved in adapter/
    from slimtune.formats.merge_source import MergeSource
    from slimtune.generate import SamplingOptions, generate, load_for_generation, prompt_ids

    loaded = load_for_generation(MergeSource(checkpoint=straight / "step-000006"), device="cpu")
    assert loaded.form == "adapter" and loaded.prompt_format == "text"
    text = generate(loaded, prompt_ids(loaded, prompt="Checkpoints are"), SamplingOptions(max_new_tokens=4, temperature=0))
    assert text == rows[5]["samples"][0]["text"]  # what the recipe sampled in memory at that step


def test_eval_path_and_plot(tmp_path, eval_settings, capsys, tiny_base):
    held = tmp_path / "held.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "held out text"}, {"text": "more held out text"}]), held)
    out = tmp_path / "run"
    settings = [s for s in eval_settings if not s.startswith("dataset.eval_fraction")]
    finetune(capsys, out, settings, f"dataset.eval_path={held}", "training.max_steps=2", "training.eval_every_n_steps=1")
    rows = metrics(out)
    assert all("eval_loss" in r for r in rows) and (out / "loss.png").stat().st_size > 0


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    from types import SimpleNamespace

    pytest.importorskip("wandb")
    from slimtune.tracking import Trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")  # no login, no network: offline mode must not need either
    logging = SimpleNamespace(tensorboard=False, wandb=SimpleNamespace(project="slimtune-test", mode="offline"))
    trackers = Trackers.from_config(SimpleNamespace(logging=logging, values={"seed": 0}), tmp_path, resume_step=0)
    trackers.log({"step": 1, "loss": 2.5, "lr": 1e-3, "eval_loss": 2.7, "samples": [{"prompt": "p", "text": "t"}]})
    trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
