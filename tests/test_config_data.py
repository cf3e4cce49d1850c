"""Recipe configs (schema, overrides, type errors) and JSONL data (shapes, prompt masking, order, batches).
In-process and fast: the byte tokenizer needs no files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slimtune.cli import build_parser
from slimtune.config import KEYS, SCHEMA, load_config, schema_markdown, shipped_configs
from slimtune.data import (
    IGNORE_INDEX,
    Record,
    collate,
    detect_format,
    epoch_order,
    epoch_steps,
    load_dataset,
    read_jsonl,
    tokenize,
)
from slimtune.errors import SlimtuneError
from slimtune.schedule import warmup_cosine
from slimtune.tiny import byte_tokenizer
from tests.conftest import ROOT

REQUIRED = ["model.path=/models/m", "dataset.path=/data/train.jsonl"]


def write_yaml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "llama3.2-1b_qlora", "llama3-8b_qlora", "llama3.2-1b_dpo", "llama3.2-1b_grpo"])
def test_shipped_configs_validate(name):
    assert name in shipped_configs()
    cfg = load_config(name, REQUIRED + ["output_dir=/tmp/run"])
    assert cfg.values.keys() == {k.name for k in SCHEMA}
    assert cfg.training.batch_size >= 1 and cfg.optimizer.lr > 0


def test_colab_configs_need_a_model_path():
    for name in ("llama3.2-1b_qlora", "llama3-8b_qlora", "llama3.2-1b_dpo", "llama3.2-1b_grpo"):
        with pytest.raises(SlimtuneError, match=r"'model.path' is required"):
            load_config(name, ["dataset.path=/d.jsonl"])


def test_tiny_paths_resolve_under_output_dir(tmp_path):
    cfg = load_config("tiny", [f"output_dir={tmp_path / 'run'}"])
    assert cfg.model.path == str(tmp_path / "run" / "base")
    assert cfg.dataset.path == str(tmp_path / "run" / "data" / "tiny.jsonl")


def test_overrides_are_yaml_scalars():
    cfg = load_config(
        "tiny",
        [
            "optimizer.lr=1e-4",  # PyYAML reads this as a string; a float key takes it as a number
            "training.max_steps=7",
            "lora.target_modules=[q_proj, v_proj]",
            "resume=true",
            "checkpoint.keep_last_n=null",
            "lora.alpha=32",  # an int is a valid float
        ],
    )
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.training.max_steps == 7
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.resume is True
    assert cfg.checkpoint.keep_last_n is None
    assert cfg.lora.alpha == 32.0


def test_keys_are_typed_section_fields():
    cfg = load_config("tiny", ["checkpoint.async=false", "dataset.columns=instruction=q,output=a"])
    assert cfg.checkpoint.async_ is False and cfg.values["checkpoint.async"] is False  # a keyword as a key name
    assert cfg.dataset.columns == {"instruction": "q", "output": "a"}
    assert list(cfg.values) == [k.name for k in SCHEMA]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0  # a validated config stays validated
    load_config("tiny").lora.target_modules.append("lm_head")
    assert "lm_head" not in load_config("tiny").lora.target_modules  # no two configs share a mutable default


@pytest.mark.parametrize(
    "override, needles",
    [
        ("optimizer.lrr=1e-4", ["unknown config key 'optimizer.lrr'", "did you mean 'optimizer.lr'"]),
        ("training.batch_size=two", ["'training.batch_size'", "an integer", "'two'"]),
        ("training.batch_size=2.5", ["'training.batch_size'", "an integer"]),
        ("training.batch_size=0", ["'training.batch_size'", ">= 1"]),
        ("resume=maybe", ["'resume'", "true or false"]),
        ("lora.dropout=1.5", ["'lora.dropout'", "< 1"]),
        ("checkpoint.merged=sometimes", ["'checkpoint.merged'", "every, final, never"]),
        ("optimizer.lr=fast", ["'optimizer.lr'", "a number"]),
        ("checkpoint.max_shard_size=big", ["'checkpoint.max_shard_size'"]),
        ("training.max_steps", ["must look like key=value"]),
        ("seed=-1", ["'seed'", ">= 0"]),
        ("checkpoint.async=yes please", ["'checkpoint.async'", "true or false"]),
    ],
)
def test_bad_overrides_name_the_key(override, needles):
    with pytest.raises(SlimtuneError) as e:
        load_config("tiny", [override])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_bad_yaml_files_name_the_key(tmp_path):
    unknown = write_yaml(tmp_path / "a.yaml", "output_dir: x\noptimizer:\n  lr: 1.0e-4\n  momentum: 0.9\n")
    with pytest.raises(SlimtuneError, match=r"a.yaml: unknown config key 'optimizer.momentum'"):
        load_config(unknown)
    not_section = write_yaml(tmp_path / "b.yaml", "output_dir: x\noptimizer: 0.1\n")
    with pytest.raises(SlimtuneError, match=r"optimizer must be a mapping"):
        load_config(not_section)
    wrong = write_yaml(tmp_path / "c.yaml", "output_dir: x\nmodel: {path: m}\ndataset: {path: d}\ntraining:\n  total_epochs: '3'\n")
    with pytest.raises(SlimtuneError, match=r"'training.total_epochs' must be an integer"):
        load_config(wrong)
    with pytest.raises(SlimtuneError, match=r"no shipped config"):
        load_config("no-such-config")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.objective=dpo", "dataset.packed=true"], "dataset.packed: preference pairs are not packed"),
        (["training.objective=dpo", "preference.label_smoothing=0.1"], "preference.label_smoothing is for simpo"),
        (["training.objective=ipo", "preference.beta=0"], "preference.beta must be above 0 for ipo"),
    ],
)
def test_rules_between_keys_are_one_line_after_every_key_checked(overrides, message):
    """Config.check runs once every key is valid on its own: the rule's one line, before any work."""
    with pytest.raises(SlimtuneError, match=message) as e:
        load_config("tiny", ["output_dir=/tmp/run", *overrides])
    assert "\n" not in str(e.value)
    with pytest.raises(SlimtuneError, match="'training.batch_size'"):  # a bad key is reported first, by its own check
        load_config("tiny", ["output_dir=/tmp/run", *overrides, "training.batch_size=0"])
    load_config("tiny", ["output_dir=/tmp/run", "training.objective=simpo", "preference.label_smoothing=0.1"])  # simpo takes it
    load_config("tiny", ["output_dir=/tmp/run", "dataset.packed=true", "preference.beta=0"])  # sft: the preference rules do not apply


def test_every_objective_the_config_names_has_an_objective():
    from slimtune.recipes.objective import Objective
    from slimtune.recipes.objectives import OBJECTIVES, objective_for

    assert set(KEYS["training.objective"].choices) == set(OBJECTIVES)
    for name in OBJECTIVES:
        objective = objective_for(load_config("tiny", ["output_dir=/tmp/run", f"training.objective={name}"]))
        assert isinstance(objective, Objective) and objective.dropped


def test_help_and_readme_come_from_the_schema(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--help"])
    help_text = capsys.readouterr().out
    for key in SCHEMA:
        assert key.name in help_text and key.help.split(";")[0][:40] in " ".join(help_text.split())
    readme = (ROOT / "docs" / "configuration.md").read_text()  # the key table moved there from the README (issue 15)
    assert schema_markdown() in readme, "docs/configuration.md's key table is stale: regenerate it with python -m slimtune.config"


# --- data -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def trained_text(tok, example) -> str:
    ids = [int(i) for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX]
    return tok.decode(ids)


def rec(data: dict) -> Record:
    return Record(data, "test.jsonl:1")


def test_alpaca_masks_the_prompt(tok):
    example = tokenize(rec({"instruction": "Add.", "input": "2+2", "output": "4"}), "alpaca", tok, 512)
    assert trained_text(tok, example) == "4<|eos|>"
    prompt = tok.decode([int(i) for i, label in zip(example.input_ids, example.labels, strict=True) if label == IGNORE_INDEX])
    assert prompt.startswith("<|bos|>Below is an instruction") and "### Input:\n2+2" in prompt and prompt.endswith("### Response:\n")


def test_chat_without_template_trains_on_assistant_turns_only(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ping?"},
        {"role": "assistant", "content": "Pong."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Pong!"},
    ]
    example = tokenize(rec({"messages": messages}), "chat", tok, 512)
    assert trained_text(tok, example) == "Pong.<|eos|>\nPong!<|eos|>\n"
    assert "Ping?" in tok.decode(example.input_ids.tolist())


def test_chat_uses_the_tokenizers_template(tok):
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    messages = [{"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."}]
    example = tokenize(rec({"messages": messages}), "chat", tok, 512)
    assert tok.decode(example.input_ids.tolist()) == "[user]Ping?[assistant]Pong.<|eos|>"
    assert trained_text(tok, example) == "Pong.<|eos|>"


def test_text_trains_on_everything_and_truncates(tok):
    example = tokenize(rec({"text": "abcdef"}), "text", tok, 512)
    assert trained_text(tok, example) == "abcdef<|eos|>"
    short = tokenize(rec({"text": "abcdef"}), "text", tok, 4)
    assert len(short.input_ids) == 4 and tok.decode(short.input_ids.tolist()) == "<|bos|>abc"


def test_examples_without_trained_tokens_are_dropped(tok):
    records = [rec({"instruction": "x" * 300, "output": "y"}), rec({"text": "kept"})]
    examples, dropped = load_dataset(records, tok, "auto", 64)
    assert dropped == 1 and len(examples) == 1
    with pytest.raises(SlimtuneError, match="no example has a trained token"):
        load_dataset(records[:1], tok, "auto", 64)


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b",}\n')
    with pytest.raises(SlimtuneError, match=r"train.jsonl:3: not valid JSON"):
        read_jsonl(path)
    path.write_text('{"text": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(SlimtuneError, match=r"train.jsonl:2: expected a JSON object, got list"):
        read_jsonl(path)


@pytest.mark.parametrize(
    "line, fmt, message",
    [
        ({"prompt": "a"}, "auto", "cannot tell the row's shape"),
        ({"text": "a"}, "alpaca", "dataset.format is alpaca"),
        ({"instruction": "a"}, "auto", "'output' must be a string"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "auto", "no assistant message"),
        ({"messages": [{"role": "user"}]}, "auto", "messages[0] must be an object"),
    ],
)
def test_bad_records_name_their_line(tok, line, fmt, message):
    record = Record(line, "train.jsonl:7")
    with pytest.raises(SlimtuneError) as e:
        tokenize(record, detect_format(record, fmt), tok, 64)
    assert "train.jsonl:7" in str(e.value) and message in str(e.value)


def test_epoch_order_is_seeded_and_changes_per_epoch():
    a = epoch_order(50, seed=3, epoch=0)
    assert a == epoch_order(50, seed=3, epoch=0)
    assert sorted(a) == list(range(50))
    assert a != epoch_order(50, seed=3, epoch=1)
    assert a != epoch_order(50, seed=4, epoch=0)
    assert epoch_order(5, seed=3, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]


def test_epoch_steps_group_micro_batches():
    steps = epoch_steps(list(range(10)), batch_size=2, accumulation=2)
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert epoch_steps(list(range(5)), batch_size=2, accumulation=1) == [[[0, 1]], [[2, 3]], [[4]]]


def test_collate_pads_right_and_masks(tok):
    examples = [tokenize(rec({"text": "abc"}), "text", tok, 64), tokenize(rec({"text": "a"}), "text", tok, 64)]
    batch = collate(examples, pad_id=256)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["input_ids"][1, 3:].tolist() == [256, 256]
    assert batch["labels"][1, 3:].tolist() == [IGNORE_INDEX, IGNORE_INDEX]


def test_warmup_then_cosine():
    factors = [warmup_cosine(s, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert 0.1 < factors[-1] < 0.12


def test_builtin_dataset_covers_every_shape(tmp_path, tok):
    from slimtune.data import builtin_tiny_records, write_jsonl

    path = write_jsonl(tmp_path / "tiny.jsonl", builtin_tiny_records())
    records = read_jsonl(path)
    assert {detect_format(r) for r in records} == {"alpaca", "chat", "text"}
    examples, dropped = load_dataset(records, tok, "auto", 256)
    assert dropped == 0 and len(examples) == len(records)
    assert all(json.loads(line) for line in path.read_text().splitlines())
