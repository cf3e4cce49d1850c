"""`slimtune demo` on the real model (SmolLM2-135M-Instruct, the converted copy `make test` fetches): the base's
and the fine-tuned merged model's greedy answers to three held-out questions, the checkpoint and its checks.
The offline demo and the fallback when the fetch fails are in test_cli.py."""

from __future__ import annotations

import json
import os

import pytest

from slimtune.demo_model import docstring_rows, question, split_held_out
from tests.conftest import run_cli


@pytest.mark.real_model
@pytest.mark.slow
def test_the_demo_shows_the_real_model_learning(tmp_path, smollm2_dir):
    out = tmp_path / "demo"
    env = {**os.environ, "SLIMTUNE_REAL_MODEL": str(smollm2_dir)}
    r = run_cli("demo", "--out", str(out), env=env, timeout=1800)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "could not fetch" not in text and "random tiny Llama" not in text
    losses = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0] - 0.5, losses
    assert "stopped after step 10; resuming from step-000010" in text
    assert "peak during save" in text and "max |logit diff| vs in-memory QLoRA model" in text and "$ slimtune export" in text
    assert (out / "model-f16.gguf").read_bytes()[:4] == b"GGUF"

    record = json.loads((out / "answers.json").read_text())
    table, loss = record["answers"], record["held_out_loss"]
    # The demo's own data files: the questions come from the functions the modules hold when imported, and a
    # test process (other test files in this worker, their libraries) may hold more than the demo's fresh one.
    train, held_out = (_rows(out / "data" / name) for name in ("train.jsonl", "eval.jsonl"))
    assert (len(train), len(held_out)) == (240, 60)
    assert [row["question"] for row in table] == [held_out[i]["messages"][0]["content"] for i in (0, 25, 50)]
    trained = {row["messages"][0]["content"] for row in train}
    assert not {row["question"] for row in table} & trained  # held out: never trained on
    for row in table:
        assert row["question"] in text and row["base"] and row["fine_tuned"] and row["base"] != row["fine_tuned"], row
    # In the direction of the data: the held-out docstrings are likelier under the fine-tuned model.
    assert loss["questions"] == 60 and loss["fine_tuned"] < loss["base"] - 0.5, loss
    assert f"base {loss['base']:.3f}, fine-tuned {loss['fine_tuned']:.3f}" in text


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_task_holds_out_every_fifth_question():
    train, held_out = docstring_rows()
    assert (len(train), len(held_out)) == (240, 60)
    assert split_held_out(list(range(10))) == ([0, 1, 2, 3, 5, 6, 7, 8], [4, 9])
    asked = [row["messages"][0]["content"] for row in train + held_out]
    assert len(set(asked)) == 300 and all(q.startswith("What does `") and q.endswith("` do in Python?") for q in asked)
    assert question("json", "dumps") == "What does `json.dumps` do in Python?"
