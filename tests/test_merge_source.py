"""``MergeSource`` (``formats/merge_source.py``): the one resolver from a command's arguments or a checkpoint
and its ``slimtune_format.json``; the adapter found in the checkpoint; the tokenizer and the format record
taken from the adapter's directory first; a bad merge base is one error line."""

import json
from pathlib import Path

import pytest

from slimtune.cli import build_parser
from slimtune.errors import SlimtuneError
from slimtune.formats.layout import FORMAT_NAME
from slimtune.formats.merge_source import MERGE_BASES, MergeSource


def _checkpoint(root: Path, merged: bool = False, record: dict | None = None) -> Path:
    """A step directory with adapter/ (and a merged model's config.json + shard, and a format record)."""
    (root / "adapter").mkdir(parents=True)
    (root / "adapter" / "adapter_config.json").write_text("{}")
    if merged:
        (root / "config.json").write_text("{}")
        (root / "model.safetensors").write_bytes(b"")
    if record is not None:
        (root / FORMAT_NAME).write_text(json.dumps(record))
    return root


def test_the_merge_base_is_checked_once_with_one_line():
    assert MERGE_BASES == ("original", "quantized")
    with pytest.raises(SlimtuneError, match=r"^merge base 'fancy': expected 'original' or 'quantized'$"):
        MergeSource("base", "adapter", "fancy")


def test_resolve_reads_the_checkpoint_and_its_format_record(tmp_path):
    trained = _checkpoint(tmp_path / "trained", record={"prompt_format": "chat", "chat_template": "{{ t }}", "nf4": {}})
    source = MergeSource.resolve(checkpoint=str(trained), base="base")
    assert source.merge_base == "quantized"  # an adapter slimtune trained on NF4: merged into what training saw
    assert source.adapter is None and source.adapter_dir == trained / "adapter"
    assert source.record["chat_template"] == "{{ t }}"
    merged = _checkpoint(tmp_path / "merged", merged=True, record={"nf4": {}})
    assert MergeSource.resolve(checkpoint=merged).merge_base == "original"  # its merged model is read as it is
    peft = _checkpoint(tmp_path / "peft")  # no record: not slimtune's training
    assert MergeSource.resolve(checkpoint=peft, base="base").merge_base == "original" and MergeSource.resolve(checkpoint=peft).record == {}
    assert MergeSource.resolve(checkpoint=trained, merge_base="original").merge_base == "original"  # as given
    assert MergeSource.resolve().adapter_dir is None


def test_the_adapter_directory_comes_first_for_the_tokenizer_and_the_record(tmp_path):
    step = _checkpoint(tmp_path / "step", record={"chat_template": "checkpoint's"})
    other = _checkpoint(tmp_path / "other")
    source = MergeSource.resolve(checkpoint=step, base="base", adapter=other / "adapter")
    assert source.adapter_dir == other / "adapter"
    assert source.tokenizer_dir(tmp_path / "base") == tmp_path / "base"  # none holds tokenizer files
    (step / "tokenizer_config.json").write_text("{}")
    assert source.tokenizer_dir(tmp_path / "base") == step
    (other / "adapter" / "tokenizer_config.json").write_text("{}")
    assert source.tokenizer_dir(tmp_path / "base") == other / "adapter"
    assert source.record == {"chat_template": "checkpoint's"}  # the adapter's directory has none: the checkpoint's


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["merge", "--base", "b", "--adapter", "a", "--out", "o"], MergeSource("b", "a")),
        (
            ["merge", "--base", "b", "--adapter", "a", "--out", "o", "--merge-base", "quantized", "--no-verify"],
            MergeSource("b", "a", "quantized", False),
        ),
        (["export", "ckpt", "--base", "b", "--merge-base", "quantized"], MergeSource("b", None, "quantized", checkpoint="ckpt")),
        (["verify", "ckpt", "--base", "b", "--adapter", "a"], MergeSource("b", "a")),
        (["generate", "ckpt", "--prompt", "x", "--no-verify"], MergeSource(None, None, verify=False, checkpoint="ckpt")),
        (["chat", "ckpt", "--base", "b"], MergeSource("b", checkpoint="ckpt")),
    ],
)
def test_every_command_resolves_its_arguments_by_the_one_resolver(argv, expected):
    source = MergeSource.from_args(build_parser().parse_args(argv))
    assert source == MergeSource(
        None if expected.base is None else Path(expected.base),
        *[getattr(expected, f) for f in ("adapter", "merge_base", "verify", "checkpoint")],
    )


def test_the_merge_base_choices_are_the_one_constant():
    """merge, export and verify take exactly ``MERGE_BASES`` (argparse refuses anything else: exit 2)."""
    for command in (["merge", "--base", "b", "--adapter", "a", "--out", "o"], ["export", "ckpt"], ["verify", "ckpt"]):
        for name in MERGE_BASES:
            assert build_parser().parse_args([*command, "--merge-base", name]).merge_base == name
        with pytest.raises(SystemExit) as refused:
            build_parser().parse_args([*command, "--merge-base", "fancy"])
        assert refused.value.code == 2
