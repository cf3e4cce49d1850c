"""Hostile inputs of ``slimtune export --format gguf`` (slimtune.gguf.export), one test per class of
issue 26: malformed tokenizer.json structure (as the tokenizers library parses it), tokenizer_config.json,
config values llama.cpp refuses or aborts on, config vs tensor disagreements, a chat template that does
not compile in transformers' sandboxed Jinja, and a flipped byte in a shard of a merged checkpoint or an
adapter checkpoint (hash checked while streaming). Each is one error line naming the file and the key,
exit 2, nothing at --out (no temporary either)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from slimtune.cli import main as slimtune_main
from tests.gguf_inputs import BAD_INPUTS, apply, tiny_merged, with_manifest


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    return tiny_merged(tmp_path_factory.mktemp("gguf-inputs") / "merged")


def _refused(capsys, out_dir: Path, *argv: str, words: tuple[str, ...] = ()) -> str:
    assert slimtune_main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "slimtune " in line]  # a merge's progress bar aside
    assert len(lines) == 1 and "internal error" not in err and "Traceback" not in err, err
    err = lines[0]
    for w in words:
        assert w in err, err
    assert not [p.name for p in out_dir.iterdir()], "nothing may be left at --out"
    return err


def test_the_good_checkpoint_exports(merged, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert slimtune_main(["export", str(merged), "--type", "q8_0", "--out", str(out / "m.gguf")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "m.gguf"]


@pytest.mark.parametrize("name,file,edit,word", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_nothing_written(merged, tmp_path, capsys, name, file, edit, word):
    src = apply(merged, tmp_path / "src", file, edit)
    out = tmp_path / "out"
    out.mkdir()
    _refused(capsys, out, "export", str(src), "--type", "f16", "--out", str(out / "m.gguf"), words=(file, word))


def _flip_tensor_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) - 100] ^= 0x40  # inside the last tensor's data, past the header
    shard.write_bytes(bytes(data))


def test_flipped_byte_in_a_merged_shard_is_refused_by_every_reader(merged, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(merged, src)
    shard = next(src.glob("*.safetensors"))
    _flip_tensor_byte(shard)
    out = tmp_path / "out"
    out.mkdir()
    words = (shard.name, "sha256")
    _refused(capsys, out, "export", str(src), "--type", "q8_0", "--out", str(out / "m.gguf"), words=words)
    _refused(capsys, out, "generate", str(src), "--prompt", "hi", "--max-new-tokens", "2", words=words)
    # --no-verify reads it as it is
    assert slimtune_main(["export", str(src), "--type", "f16", "--out", str(out / "m.gguf"), "--no-verify"]) == 0


def test_flipped_byte_in_an_adapter_checkpoint_is_refused(merged, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    ckpt = tmp_path / "step-000001"
    peft_model.save_pretrained(ckpt / "adapter")
    with_manifest(ckpt, "adapter")
    _flip_tensor_byte(ckpt / "adapter" / "adapter_model.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    words = ("adapter_model.safetensors", "sha256")
    _refused(capsys, out, "export", str(ckpt), "--base", str(merged), "--type", "f16", "--out", str(out / "m.gguf"), words=words)
    _refused(capsys, out, "merge", "--base", str(merged), "--adapter", str(ckpt / "adapter"), "--out", str(out / "m"), words=words)
    _refused(capsys, out, "merge", "--base", str(merged), "--adapter", str(ckpt), "--out", str(out / "m"), words=words)  # the step dir
    # the base, a merged checkpoint with a manifest, is checked too
    base = tmp_path / "base"
    shutil.copytree(merged, base)
    _flip_tensor_byte(next(base.glob("*.safetensors")))
    shutil.rmtree(ckpt)
    peft_model.save_pretrained(ckpt / "adapter")
    _refused(capsys, out, "merge", "--base", str(base), "--adapter", str(ckpt / "adapter"), "--out", str(out / "m"), words=("sha256",))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int16])
def test_integer_target_with_quantized_merge_base_is_one_line(merged, tmp_path, capsys, dtype):
    """A LoRA-targeted base weight stored as an integer dtype has no NF4 form: merge and export with
    --merge-base quantized refuse it in one line (it was exit 3: abs_cpu / mean() on an integer tensor)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(merged), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    base = tmp_path / "base"
    shutil.copytree(merged, base)
    (base / "slimtune_manifest.json").unlink()
    shard = next(base.glob("*.safetensors"))
    tensors = load_file(shard)
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key].view(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    words = (key, "quantized")
    q = ("--merge-base", "quantized")
    _refused(capsys, out, "merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(out / "m"), *q, words=words)
    _refused(
        capsys, out, "export", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(out / "m.gguf"), *q, words=words
    )


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_weight_is_one_line_for_every_kind_of_type(merged, tmp_path, capsys, bad):
    """A NaN or an infinity in a stored bf16 weight: one line naming the tensor for a cast type (f16: checked
    before the cast), a legacy block type (q8_0) and a K-quant mix (q6_k: Q6_K / its Q8_0 fallback; found
    by the quantizers from their block maxima, on their threads), nothing at --out."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(merged, src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key][3, 17] = bad
    save_file(tensors, shard, metadata={"format": "pt"})
    with_manifest(src)
    out = tmp_path / "out"
    out.mkdir()
    for typ in ("f16", "q8_0", "q6_k"):
        _refused(capsys, out, "export", str(src), "--type", typ, "--out", str(out / "m.gguf"), words=(key, "NaN or infinite"))


def test_a_damaged_small_file_is_refused_before_any_parser_reads_it(merged, tmp_path):
    """tokenizer_config.json changed after the manifest (its chat_template a number, which the ``gguf``
    package would parse and warn about): the hash check refuses it before any library reads it, and the
    export's whole stderr is that one line (a real process: nothing a library prints comes first)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    src = tmp_path / "src"
    shutil.copytree(merged, src)
    cfg = src / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = 5
    cfg.write_text(json.dumps(data))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "slimtune", "export", str(src), "--type", "q8_0", "--out", str(out / "m.gguf")]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "tokenizer_config.json" in lines[0] and "the manifest says" in lines[0], lines[0]
    assert not list(out.iterdir())
