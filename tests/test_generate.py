"""Talking to a checkpoint: `slimtune generate` and `slimtune chat` on the merged model and on the adapter
applied to the NF4 base; seeded sampling; the saved tokenizer's chat template; the model card."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from slimtune.cli import main
from slimtune.config import load_config
from slimtune.data import Record, tokenize
from slimtune.formats.merge_source import MergeSource
from slimtune.generate import SamplingOptions, generate, load_for_generation, prompt_ids
from slimtune.recipes.finetune import run_finetune
from slimtune.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory) -> Path:
    """The demo's recipe (tiny config, built-in data), shortened: 20 steps, merged model and adapter."""
    out = tmp_path_factory.mktemp("gen") / "run"
    values = {
        "output_dir": str(out),
        "training.max_steps": 20,
        "training.total_epochs": 100,
        "logging.progress_bar": False,
        "checkpoint.save_every_n_steps": 20,
        "dataset.eval_fraction": 0.2,
        "training.sample_prompts": ["Can training resume?"],
        "training.sample_max_new_tokens": 8,
    }
    result = run_finetune(load_config("tiny", values=values))
    return result.checkpoint


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2**-30))) - 7)


def test_greedy_is_equal_on_merged_and_adapter_on_nf4_base(demo_checkpoint):
    """The two forms differ only by the one bf16 rounding of each merged weight, so their greedy tokens are
    the same except where the top two logits are that close (a near-tie). Stepped together on the merged
    form's choices: every step agrees, or both forms rank the two tokens within 4 bf16 ulps of each other."""
    merged = load_for_generation(MergeSource(checkpoint=demo_checkpoint), form="merged", device="cpu")
    adapter = load_for_generation(MergeSource(checkpoint=demo_checkpoint), form="adapter", device="cpu")
    assert (merged.form, adapter.form) == ("merged", "adapter") and merged.prompt_format == "chat"
    greedy = SamplingOptions(max_new_tokens=24, temperature=0.0)
    steps, ties = 0, 0
    for prompt in ("Can training resume?", "Is the adapter loadable?", "What is written last in a checkpoint?"):
        ids = prompt_ids(merged, prompt=prompt)
        assert ids == prompt_ids(adapter, prompt=prompt)
        a, b = generate(merged, ids, greedy), generate(adapter, ids, greedy)
        assert len(a) > 0 and len(b) > 0
        seq, clear = list(ids), True
        with torch.no_grad():
            for _ in range(greedy.max_new_tokens):
                lm = merged.model(torch.tensor([seq])).logits[0, -1].float()
                la = adapter.model(torch.tensor([seq])).logits[0, -1].float()
                tm, ta = int(lm.argmax()), int(la.argmax())
                top2 = lm.topk(2).values
                clear = clear and float(top2[0] - top2[1]) > 8 * _bf16_ulp(float(lm.abs().max()))
                steps += 1
                if tm != ta:
                    gap = max(float(lm[tm] - lm[ta]), float(la[ta] - la[tm]))
                    assert gap <= 4 * _bf16_ulp(float(lm.abs().max())), f"{prompt!r}: forms disagree by {gap} at step {len(seq) - len(ids)}"
                    ties += 1
                seq.append(tm)
        if clear:  # no near-tie anywhere on the way: generate() (with its KV cache) gives the same text on both forms
            assert a == b, prompt
    assert ties <= steps // 8, f"{ties} near-ties in {steps} steps"


def test_sampling_is_deterministic_with_a_seed(demo_checkpoint):
    loaded = load_for_generation(MergeSource(checkpoint=demo_checkpoint), device="cpu")
    ids = prompt_ids(loaded, prompt="Name the format.")
    first = generate(loaded, ids, SamplingOptions(max_new_tokens=16, temperature=1.0, seed=7))
    assert generate(loaded, ids, SamplingOptions(max_new_tokens=16, temperature=1.0, seed=7)) == first
    others = {generate(loaded, ids, SamplingOptions(max_new_tokens=16, temperature=1.0, seed=s)) for s in range(3)}
    assert len(others | {first}) > 1  # the seed matters
    streamed: list[str] = []
    assert generate(loaded, ids, SamplingOptions(max_new_tokens=16, temperature=1.0, seed=7), on_text=streamed.append) == first
    assert "".join(streamed) == first


def test_saved_chat_template_reproduces_the_training_ids(demo_checkpoint):
    """The base tokenizer has no template; training used the fallback one, and the checkpoint carries it."""
    messages = [{"role": "user", "content": "Can training resume?"}, {"role": "assistant", "content": "Yes, exactly."}]
    trained = tokenize(Record({"messages": messages}, "t"), "chat", byte_tokenizer(), 256).input_ids.tolist()
    for where in (demo_checkpoint, demo_checkpoint / "adapter"):
        tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        assert tok.chat_template
        assert tok.apply_chat_template(messages, tokenize=True, return_dict=False) == trained


def test_model_card_and_format_record(demo_checkpoint):
    card = (demo_checkpoint / "README.md").read_text()
    assert card == (demo_checkpoint / "adapter" / "README.md").read_text()
    data = demo_checkpoint.parent / "data" / "tiny.jsonl"
    import hashlib

    assert hashlib.sha256(data.read_bytes()).hexdigest() in card
    for needle in ("step 20", "eval loss", "r = 8", "NF4", "PeftModel.from_pretrained", "AutoModelForCausalLM", "slimtune generate"):
        assert needle in card, needle
    record = json.loads((demo_checkpoint / "slimtune_format.json").read_text())
    assert record["prompt_format"] == "chat" and record["shapes"]["alpaca"] > 0
    metrics = [json.loads(line) for line in (demo_checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    samples = [m["samples"] for m in metrics if "samples" in m]
    assert samples and samples[-1][0]["prompt"] == "Can training resume?"


def test_cli_generate_and_chat(demo_checkpoint, tmp_path, capsys, monkeypatch):
    """The commands in this process (a fresh interpreter per call costs more than the whole test)."""
    code = main(["generate", str(demo_checkpoint), "--prompt", "Can training resume?", "--temperature", "0", "--max-new-tokens", "12"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "[merged model, chat format]" in out.err
    loaded = load_for_generation(MergeSource(checkpoint=demo_checkpoint), device="cpu")
    expected = generate(loaded, prompt_ids(loaded, prompt="Can training resume?"), SamplingOptions(max_new_tokens=12, temperature=0))
    assert out.out == expected + "\n"
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Can training resume?"}]))
    args = ["--messages", str(messages), "--temperature", "0", "--max-new-tokens", "12", "--form", "adapter"]
    code = main(["generate", str(demo_checkpoint), *args])
    out = capsys.readouterr()
    assert code == 0 and out.out == expected + "\n" and "[adapter model" in out.err, out.err
    monkeypatch.setattr("sys.stdin", io.StringIO("Can training resume?\n/exit\n"))
    code = main(["chat", str(demo_checkpoint), "--temperature", "0", "--max-new-tokens", "12"])
    out = capsys.readouterr()
    assert code == 0 and expected in out.out, out.err
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "shapes, expected",
    [
        ({"chat": 4}, "chat"),
        ({"sharegpt": 1, "text": 9}, "chat"),
        ({"conversational": 300}, "chat"),  # DPO/IPO/SimPO pairs of messages
        ({"standard": 300}, "text"),  # pairs of strings
        ({"alpaca": 5, "text": 5}, "alpaca"),
        ({"text": 3}, "text"),
        ({"chat": 0, "alpaca": 2}, "alpaca"),
        ({}, "text"),
    ],
)
def test_the_prompt_format_follows_the_rows_of_every_objective(shapes, expected):
    from slimtune.formats.format_record import new_format_record, prompt_format_of

    assert prompt_format_of(shapes) == expected == new_format_record(shapes, None)["prompt_format"]
