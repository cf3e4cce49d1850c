"""formats/hf.py's index reader and index checker, and formats/peft.py's adapter-config parser, called by
name on small hand-made inputs (the fuzzers in test_fuzz.py throw mutated ones at the same readers)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from slimtune.errors import SlimtuneError
from slimtune.formats.hf import INDEX_NAME, checkpoint_files, index_problems, read_index
from slimtune.formats.peft_config import parse_lora_config
from slimtune.formats.safetensors import read_header


def _index(path, weight_map, total=None):
    data = {"weight_map": weight_map, **({"metadata": {"total_size": total}} if total is not None else {})}
    path.write_text(json.dumps(data))
    return path


def test_read_index_returns_the_map_and_the_total(tmp_path):
    weight_map, total = read_index(_index(tmp_path / INDEX_NAME, {"a": "one.safetensors"}, 8))
    assert weight_map == {"a": "one.safetensors"} and total == 8
    assert read_index(_index(tmp_path / INDEX_NAME, {"a": "one.safetensors"}))[1] is None
    for bad, needle in [({"a": "../x"}, "expected a file name beside the index"), ([], "weight_map must be an object")]:
        with pytest.raises(SlimtuneError, match=needle):
            read_index(_index(tmp_path / INDEX_NAME, bad))
    with pytest.raises(SlimtuneError, match="total_size must be a non-negative integer"):
        read_index(_index(tmp_path / INDEX_NAME, {"a": "one.safetensors"}, -1))


def test_index_problems_lists_every_disagreement_and_the_loader_raises_the_first(tmp_path):
    save_file({"a": torch.zeros(2), "stray": torch.zeros(1)}, tmp_path / "one.safetensors")
    index = _index(tmp_path / INDEX_NAME, {"a": "one.safetensors", "b": "one.safetensors", "c": "gone.safetensors"}, 999)
    weight_map, total = read_index(index)
    headers = {"one.safetensors": read_header(tmp_path / "one.safetensors")}
    assert list(index_problems(index, weight_map, headers, total)) == [
        f"{index}: lists gone.safetensors, which is missing from {tmp_path}",
        f"{index}: tensor stray is in one.safetensors but the index says nothing",
        f"{index}: maps tensor b to one.safetensors, which does not hold it",
    ]  # total_size is not compared while a shard is missing
    with pytest.raises(SlimtuneError, match="lists gone.safetensors, which is missing"):
        checkpoint_files(tmp_path)
    index = _index(tmp_path / INDEX_NAME, {"a": "one.safetensors", "stray": "one.safetensors"}, 999)
    assert list(index_problems(index, *read_index(index)[:1], headers, 999)) == [
        f"{index}: total_size 999 but the shards hold 12 bytes of tensors"
    ]
    assert [h.path.name for h in checkpoint_files(tmp_path)] == ["one.safetensors"]  # loaders do not check total_size


def test_parse_lora_config_reads_peft_fields_and_refuses_what_the_merge_does_not_implement():
    settings = parse_lora_config(
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True, "rank_pattern": {"v_proj": 2}}, "cfg"
    )
    assert (settings.r, settings.lora_alpha, settings.target_modules, settings.use_rslora) == (4, 8, ["q_proj", "v_proj"], True)
    assert settings.rank_pattern == {"v_proj": 2} and settings.use_dora is False and settings.init_lora_weights is True
    assert parse_lora_config({"target_modules": "all-linear"}, "cfg").target_modules == "all-linear"
    faults = [
        ({"target_modules": ["q"], "r": 0}, "r must be a positive integer"),
        ({"target_modules": ["q"], "bias": "all"}, "adapters that train biases are not supported"),
        ({"r": 4}, "target_modules is missing"),
        ({"target_modules": ["q"], "peft_type": "IA3"}, "only LORA adapters can be merged"),
        ({"target_modules": ["q"], "use_dora": "yes"}, "use_dora must be true or false"),
    ]
    for config, needle in faults:
        with pytest.raises(SlimtuneError, match=needle):
            parse_lora_config(config, "cfg")


def test_checkpoint_layout_finds_the_adapter_the_merged_model_and_the_record(tmp_path):
    from slimtune.formats.layout import ADAPTER_CONFIG, FORMAT_NAME, CheckpointLayout

    step = tmp_path / "step-000001"
    (step / "adapter").mkdir(parents=True)
    layout = CheckpointLayout(str(step))
    assert layout.root == step and layout.adapter_dir is None and not layout.has_merged and layout.format_record is None
    (step / "adapter" / ADAPTER_CONFIG).write_text("{}")
    (step / "config.json").write_text("{}")
    assert layout.adapter_dir == step / "adapter" and not layout.has_merged  # config.json alone is no model
    (step / "model.safetensors").write_bytes(b"")
    (step / FORMAT_NAME).write_text("{}")
    assert layout.has_merged and layout.format_record == step / FORMAT_NAME
    inner = CheckpointLayout(step / "adapter")
    assert inner.adapter_dir == step / "adapter" and inner.format_record == step / FORMAT_NAME  # the checkpoint's, from adapter/
    (step / ADAPTER_CONFIG).write_text("{}")
    assert layout.adapter_dir == step  # a PEFT save at the root is the adapter itself
