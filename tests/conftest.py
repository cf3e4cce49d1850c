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

from slimtune.cli import quiet_library_logs

quiet_library_logs()  # the test session is the application: it decides what libraries log (before they load)

from slimtune.lora import LoRAConfig, lora_modules  # noqa: E402
from slimtune.model import load_qlora_model  # noqa: E402
from slimtune.tiny import make_tiny_checkpoint  # noqa: E402

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
