"""``slimtune_format.json`` (``formats/format_record.py``): made, written and read back, from a checkpoint
or its ``adapter/``; a malformed one is one error line."""

import json

import pytest

from slimtune.errors import SlimtuneError
from slimtune.formats.format_record import new_format_record, prompt_format_of, read_format_record, write_format_record
from slimtune.formats.layout import FORMAT_NAME
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE


def test_read_format_record_from_a_checkpoint_or_its_adapter(tmp_path):
    step = tmp_path / "step-3"
    (step / "adapter").mkdir(parents=True)
    assert read_format_record(step) == {}
    (step / "slimtune_format.json").write_text(json.dumps({"prompt_format": "chat", "chat_template": "{{ x }}"}))
    assert read_format_record(step)["chat_template"] == "{{ x }}" == read_format_record(step / "adapter")["chat_template"]
    (step / "slimtune_format.json").write_text("[1]")
    assert read_format_record(step) == {}
    (step / "slimtune_format.json").write_text("{")
    with pytest.raises(SlimtuneError, match="slimtune_format.json"):
        read_format_record(step)


def test_a_written_record_reads_back_as_made(tmp_path):
    record = {**new_format_record({"alpaca": 3, "chat": 0}, None), "nf4": {"block_size": 64}}
    assert record["prompt_format"] == "alpaca" and record["chat_template"] == FALLBACK_CHAT_TEMPLATE
    write_format_record(tmp_path / FORMAT_NAME, record)
    assert read_format_record(tmp_path) == record == json.loads((tmp_path / FORMAT_NAME).read_text())
    assert [prompt_format_of(s) for s in ({"sharegpt": 1}, {"alpaca": 2}, {"text": 5}, {})] == ["chat", "alpaca", "text", "text"]
