"""Thread choice and regional compilation (training.num_threads, training.compile)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slimtune.config import load_config
from slimtune.logs import configure_logging
from slimtune.recipes.finetune import run_finetune
from slimtune.runtime import choose_num_threads, decoder_layers, usable_cores


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_affinity_and_local_ranks_not_load(monkeypatch, restore_threads):
    cores = usable_cores()
    assert cores == len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert choose_num_threads(None) == cores == torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more ranks than cores: one thread each
    assert choose_num_threads(None) == 1 == torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_num_threads(None) == 4
    monkeypatch.setattr(os, "getloadavg", lambda: (20.0, 20.0, 20.0))  # a loaded machine changes nothing: reproducible runs
    assert choose_num_threads(None) == 4
    assert choose_num_threads(3) == 3 == torch.get_num_threads()  # training.num_threads wins


def test_num_threads_is_validated(tmp_path):
    from slimtune.errors import SlimtuneError

    with pytest.raises(SlimtuneError, match="training.num_threads"):
        load_config("tiny", [f"output_dir={tmp_path}", "training.num_threads=0"])
    assert load_config("tiny", [f"output_dir={tmp_path}", "training.num_threads=3"]).training.num_threads == 3


def _run(tiny_base, data, out, compile: bool, capsys) -> tuple[list[float], str]:
    values = {
        "model.path": str(tiny_base),
        "model.create_tiny": False,
        "dataset.path": str(data),
        "dataset.shuffle": False,
        "dataset.max_seq_len": 64,
        "training.max_steps": 3,
        "training.compile": compile,
        "training.num_threads": 1,
        "checkpoint.merged": "never",
        "logging.progress_bar": False,
    }
    cfg = load_config("tiny", [f"output_dir={out}"], values=values)
    configure_logging()  # the recipe's lines printed as the CLI prints them
    losses = run_finetune(cfg).losses
    return losses, capsys.readouterr().out


def test_compiled_layers_train_like_eager(tiny_base, tmp_path, capsys, restore_threads):
    """training.compile=true: every decoder layer compiled by inductor (on the CPU here), the losses of
    3 steps equal eager's within bf16 tolerance, the cold start logged."""
    from torch._dynamo.utils import counters

    # each batch of 4 (file order): two texts cut to max_seq_len and two shorter ones, so every step has the
    # same shape (4 x 64) and padding (an attention mask): the layers compile once per input kind (without
    # and with grad: the second layer's input carries the first one's LoRA) and not again for a new shape or
    # a missing mask (the built-in data, shuffled, compiled 4 graphs: 46 s instead of 38 s, cold cache)
    data = tmp_path / "train.jsonl"
    long, short = "The quick brown fox jumps over the lazy dog. " * 3, "Loss goes down {}."
    rows = [{"text": f"{i}: {long}"} if i % 2 == 0 else {"text": short.format(i)} for i in range(12)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    torch._dynamo.reset()
    counters.clear()
    eager, _ = _run(tiny_base, data, tmp_path / "eager", False, capsys)
    compiled, log = _run(tiny_base, data, tmp_path / "compiled", True, capsys)
    try:
        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
        assert "compile: 2 decoder layers" in log and "compile: cold start, the first step" in log
        assert len(eager) == len(compiled) == 3
        for a, b in zip(eager, compiled, strict=True):
            assert abs(a - b) <= 0.01 * abs(a), (eager, compiled)
        assert eager[0] != eager[-1]  # it trained: the later losses depend on the updates
    finally:
        torch._dynamo.reset()


def test_decoder_layers_found(qlora_model):
    layers = decoder_layers(qlora_model)
    assert len(layers) == qlora_model.config.num_hidden_layers
    assert all(type(m).__name__ == "LlamaDecoderLayer" for m in layers)
