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


def _fuzz_run(driver: str, seed: int, cases: int) -> dict:
    """``tests/DRIVER.py``'s main in a fresh process: its figures (printed), every case run."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extras")
    result = run_python(f"from tests.{driver} import main; main(['--seed', '{seed}', '--cases', '{cases}'])", timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    figures = json.loads(lines[-1])
    print(f"{driver} figures: {json.dumps({k: v for k, v in figures.items() if k != 'failures'})}")
    assert figures["cases"] >= cases
    return figures


def test_fuzzed_gguf_export_inputs_refuse_cleanly_or_load_in_llama_cpp():
    """tests/fuzz_export.py: 200 mutated copies of a tiny merged checkpoint (tokenizer.json, tokenizer_config.json,
    chat template, config.json, shard bytes) through `slimtune export`; each file written loads in llama.cpp
    (one long-lived process: full load, a few tokens evaluated). No internal error, crash, refusal by
    llama.cpp, hang, memory growth or leftover."""
    figures = _fuzz_run("fuzz_export", seed=3, cases=200)
    assert all(figures[k] == 0 for k in BAD_OUTCOMES), figures["failures"]
    assert figures["ok"] >= 20 and figures["clean"] >= 20, figures


def test_fuzzed_adapter_gguf_exports_refuse_cleanly_or_apply_in_llama_cpp():
    """tests/fuzz_adapter.py: 30 mutated copies of a small PEFT LoRA adapter (adapter_config.json values, target
    modules, ranks, alpha and patterns, tensor names, shapes, dtypes and values, header bytes, --type and
    --base-gguf) through `slimtune export --adapter-only`; each adapter written is applied by llama.cpp to
    the base's f16 GGUF. No internal error, crash, refusal by llama.cpp, hang, memory growth or leftover."""
    figures = _fuzz_run("fuzz_adapter", seed=1, cases=30)
    assert all(figures[k] == 0 for k in BAD_OUTCOMES), figures["failures"]
    assert figures["ok"] >= 3 and figures["clean"] >= 10, figures


HOSTILE_PAIR_ROWS = {
    "wrong types": b'{"prompt": "p", "chosen": 3, "rejected": "r"}',
    "nested junk": b'{"prompt": [[[{"role": {"x": []}}]]], "chosen": [], "rejected": []}',
    "huge string": b'{"prompt": "' + b"x" * 100_000 + b'", "chosen": " a", "rejected": " b"}',
    "missing key": b'{"prompt": "p", "rejected": "r"}',
    "not UTF-8": b'{"prompt": "p\xff\xfe", "chosen": "a", "rejected": "b"}',
    "bad messages": b'{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant"}], "rejected": "b"}',
    "bad message content": b'{"prompt": [{"role": "user", "content": ["hi"]}], "chosen": [], "rejected": []}',
}


def test_hostile_preference_rows_exit_2_with_one_line_naming_file_and_row(tmp_path, capsys):
    """The preference reader (fuzzed above, tests/fuzz_readers.fuzz_preference) through the CLI: each hostile
    third row of a file stops `slimtune finetune training.objective=dpo` with exit 2 and one stderr line
    naming the file and row, no traceback, nothing written (the data is read before the tiny base)."""
    from slimtune.cli import main

    good = b'{"prompt": "Say red:", "chosen": " red.", "rejected": " blue!"}\n'
    for i, (what, row) in enumerate(HOSTILE_PAIR_ROWS.items()):
        data = tmp_path / f"pairs{i}.jsonl"
        data.write_bytes(good * 2 + row + b"\n")
        out = tmp_path / f"run{i}"
        argv = ["finetune", "--config", "tiny", f"output_dir={out}", f"dataset.path={data}", "dataset.max_seq_len=1024"]
        assert main([*argv, "training.objective=dpo", "logging.progress_bar=false"]) == 2, what
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"slimtune finetune: error: {data}:3: "), (what, err[:300])
        assert "Traceback" not in err and not out.exists(), what
