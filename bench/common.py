"""What the benches share: the disk's own write speed, the synthetic bases they write once and reuse, the
real model's cache, and the fresh child process a measured job runs in.

The models are synthetic but of the real shape (``slimtune.synthetic``): random NF4 codes and scalers for
every projection, random bf16 for embeddings and norms, LoRA r=8 on q_proj and v_proj. Figures are
measured in the process that does the job: peak RSS from VmHWM (reset before it), bytes written from
/proc/self/io wchar, and the disk's own sequential write speed (with fsync) measured in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.synthetic import preset_config, write_synthetic_adapter, write_synthetic_base
from slimtune.tiny import byte_tokenizer

ROOT = Path(__file__).resolve().parent.parent  # the repository: ``bench`` is importable from here


def disk_write_mb_s(directory: Path, nbytes: int, block: int = 16 * 1024 * 1024) -> float:
    """Sequential write of ``nbytes`` with fsync, as the save does: the disk's own speed here."""
    path = directory / ".slimtune-disk-probe"
    buf = os.urandom(block)
    start = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(buf)
            written += block
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return written / seconds / 1e6


def disk_direct_write_mb_s(directory: Path, nbytes: int, block: int = 8 * 1024 * 1024) -> float | None:
    """Sequential write of ``nbytes`` (rounded up to ``block``) with O_DIRECT, past the page cache, then fsync:
    the disk's speed for a writer that bypasses the cache as the GGUF export's does (``DirectAppend``), and
    for the volume it writes (the buffered 2 GB probe above lands in the host's caches: on this VM it read
    0.4-0.9 GB/s where this read 2.2-2.9 GB/s for 8.5 GB). None where the filesystem refuses O_DIRECT."""
    import mmap

    path = directory / ".slimtune-direct-probe"
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return None
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, buf)
        os.fsync(fd)
        seconds = time.perf_counter() - start
    except OSError:
        return None
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return written / seconds / 1e6


def synthetic_base_and_adapter(preset: str, out: Path, layers: int | None, vocab: int | None = None) -> tuple[str, Path, Path]:
    """The preset's synthetic base and adapter under ``out`` (written once, reused while complete); ``vocab``:
    at least this many embedding rows (a tokenizer bigger than the preset's vocabulary, e.g. SmolLM2's for tiny)."""
    fields = {"num_hidden_layers": layers} if layers else {}
    if vocab is not None and vocab > preset_config(preset).vocab_size:
        fields["vocab_size"] = vocab
    config = preset_config(preset, **fields)
    tag = preset + (f"-{layers}l" if layers else "") + (f"-v{vocab}" if "vocab_size" in fields else "")
    base, adapter = out / f"base-{tag}", out / f"adapter-{tag}"
    if not is_complete_checkpoint(base):
        write_synthetic_base(config, base)
    if not is_complete_checkpoint(adapter):
        write_synthetic_adapter(config, adapter)
    return tag, base, adapter


def synthetic_train_base(out: Path, preset: str, layers: int | None = None) -> Path:
    """A random bf16 checkpoint of the preset's shape (``layers`` of them) with the byte-level tokenizer,
    written once, where ``merge`` looks for its base (``base-PRESET[-Nl]``): train-step, gpu_check."""
    target = out / f"base-{preset}" if layers is None else out / f"base-{preset}-{layers}l"
    if not is_complete_checkpoint(target):
        write_synthetic_base(preset_config(preset, **({"num_hidden_layers": layers} if layers else {})), target)
    if not (target / "tokenizer.json").is_file():
        byte_tokenizer().save_pretrained(str(target))
    return target


def real_model_dir() -> Path:
    return Path(os.environ.get("SLIMTUNE_REAL_MODEL", ".cache/real-model/SmolLM2-135M-Instruct"))


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH: ``python -m bench.X`` works
    from any directory."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def run_child(module: str, *args: str, what: str) -> dict:
    """``python -m MODULE ARGS`` in a fresh process (``bench`` importable from the repository), its
    figures: the last line it prints, as JSON. A failed child ends the bench with one line.

    Example: ``run_child("bench.merge_child", str(base), str(adapter), str(out), "cpu", what="merge")``"""
    child = subprocess.run([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True, env=child_env())
    if child.returncode:
        raise SystemExit(f"{what} failed with exit code {child.returncode}")
    return json.loads(child.stdout.strip().splitlines()[-1])
