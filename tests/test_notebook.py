"""notebooks/colab_qlora.ipynb runs top to bottom: the same cells a Colab user runs on a T4, here on the CPU
with the embedded tiny model and a local alpaca-shaped dataset, its parameters cell replaced (nbclient)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "colab_qlora.ipynb"

pytestmark = pytest.mark.slow


def _parameters_cell(nb) -> int:
    (index,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    return index


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_the_notebook_is_committed_clean_with_colab_parameters():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    params = nb.cells[_parameters_cell(nb)].source
    assert 'MODEL = "unsloth/Llama-3.2-1B-Instruct"' in params and "INSTALL = True" in params and 'GGUF_TYPE = "q4_k_m"' in params
    assert "hf_" not in json.dumps(nb)  # no token in the notebook


def test_the_notebook_runs_on_the_cpu_with_a_tiny_model(tmp_path, tiny_base, monkeypatch):
    rows = [{"instruction": f"Fact {i}?", "input": "" if i % 2 else "Be brief.", "output": f"Fact {i}: saves stream."} for i in range(12)]
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells[_parameters_cell(nb)].source = "\n".join(
        [
            f"REPO = {str(ROOT)!r}",
            "INSTALL = False",
            f"MODEL = {str(tiny_base)!r}",
            'CONFIG = "tiny"',
            f"DATASET = {str(data)!r}",
            "ROWS = 8",
            "STEPS = 4",
            "MAX_SEQ_LEN = 64",
            f"OUT = {str(out)!r}",
            'QUESTION = "What is a checkpoint?"',
            'GGUF_TYPE = "q4_k_m"',
        ]
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports this checkout's slimtune
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: the loss plot is an output
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    texts = [_text(c) for c in nb.cells if c.cell_type == "code"]
    assert any(t.startswith("8 rows written to") for t in texts), texts
    (trained,) = [t for t in texts if "loss " in t and " over 4 steps; checkpoint: " in t]
    assert [line.split()[0] for line in trained.splitlines()[:2]] == ["step", "step"], trained
    (answers,) = [t for t in texts if "fine-tuned:" in t]
    assert answers.startswith("Q: What is a checkpoint?") and "base model:" in answers
    plots = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(plots) == 1
    ckpt = max(p for p in out.glob("step-*") if p.is_dir())  # the newest (the tiny config saves at each epoch's end)
    assert f"over 4 steps; checkpoint: {ckpt}" in trained
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and (ckpt / "config.json").is_file()
    gguf = out / "model-q4_k_m.gguf"
    assert gguf.is_file() and gguf.read_bytes()[:4] == b"GGUF"
    assert "FROM " in (out / "Modelfile").read_text()
    (exported,) = [t for t in texts if "Modelfile:" in t]
    assert f"wrote {gguf}: q4_k_m" in exported and "FROM " in exported
    assert any(f"verify {ckpt}: " in t and "manifest: OK" in t for t in texts)
