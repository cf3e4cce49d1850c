"""The reader fuzzers (tests/fuzz_readers.py), run in a fresh process so their peak memory is theirs:
over 10,000 seeded cases across every reader, no exception but SlimtuneError, no case near a hang, and
no allocation anywhere near 256 MB from inputs under 1 MB."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python


def test_fuzzed_readers_refuse_cleanly_fast_and_in_bounded_memory():
    result = run_python("import sys; from tests.fuzz_readers import main; main(['--seed', '7'])", timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    figures = json.loads(lines[-1])
    print(f"fuzz figures: {json.dumps({k: v for k, v in figures.items() if k != 'failures'})}")
    assert figures["crashed"] == 0, figures["failures"]
    assert figures["cases"] >= 10_000
    assert all(s["accepted"] > 0 and s["refused"] > 0 for s in figures["per_reader"].values()), figures["per_reader"]
    assert figures["slowest_case_s"] < 10
    assert figures["largest_input_bytes"] < 1 << 20
    assert figures["peak_rss_growth_mb"] < 256


BAD_OUTCOMES = ("internal", "crash", "refused", "hang", "memory", "leftover")


def test_fuzzed_gguf_export_inputs_refuse_cleanly_or_load_in_llama_cpp():
    """tests/fuzz_export.py: 200 mutated copies of a tiny merged checkpoint (tokenizer.json, tokenizer_config.json,
    chat template, config.json, shard bytes) through `slimtune export`; each file written loads in llama.cpp
    (one long-lived process: full load, a few tokens evaluated). No internal error, crash, refusal by
    llama.cpp, hang, memory growth or leftover."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extras")
    result = run_python("from tests.fuzz_export import main; main(['--seed', '3', '--cases', '200'])", timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    figures = json.loads(lines[-1])
    print(f"gguf export fuzz figures: {json.dumps({k: v for k, v in figures.items() if k != 'failures'})}")
    assert figures["cases"] >= 200
    assert all(figures[k] == 0 for k in BAD_OUTCOMES), figures["failures"]
    assert figures["ok"] >= 20 and figures["clean"] >= 20, figures


def test_fuzzed_adapter_gguf_exports_refuse_cleanly_or_apply_in_llama_cpp():
    """tests/fuzz_adapter.py: 30 mutated copies of a small PEFT LoRA adapter (adapter_config.json values, target
    modules, ranks, alpha and patterns, tensor names, shapes, dtypes and values, header bytes, --type and
    --base-gguf) through `slimtune export --adapter-only`; each adapter written is applied by llama.cpp to
    the base's f16 GGUF. No internal error, crash, refusal by llama.cpp, hang, memory growth or leftover."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extras")
    result = run_python("from tests.fuzz_adapter import main; main(['--seed', '1', '--cases', '30'])", timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    figures = json.loads(lines[-1])
    print(f"adapter gguf fuzz figures: {json.dumps({k: v for k, v in figures.items() if k != 'failures'})}")
    assert figures["cases"] >= 30
    assert all(figures[k] == 0 for k in BAD_OUTCOMES), figures["failures"]
    assert figures["ok"] >= 3 and figures["clean"] >= 10, figures
