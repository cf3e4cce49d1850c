"""How long a background writer outlives its trainer. A trainer (forked from the caller, which holds
a QLoRA model) hands one merged save to a forked writer at nice 19 and is SIGKILLed, as the OOM killer
does, while two busy processes hold the cores; the figure is the seconds from the kill until the writer
is gone. ``inside_call``: the writer is first held inside one long C call that releases the GIL and
never looks at signals (a pbkdf2 of minutes, at its fsync of the adapter): its SIGTERM cannot act, so
its watchdog must end it. Else the kill comes at a random moment of the save.

``tests/test_background.py`` runs a few of these; the figure of 30 (not run by the suite)::

    PYTHONPATH=$PWD python tests/writer_lifetime.py --kills 30
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch import nn

from slimtune.checkpoint.background import BackgroundSaver, WriterKind, WriterSpec
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import SaveOptions
from slimtune.checkpoint.writer import WriteOptions
from slimtune.lora import LoRAConfig
from tests.conftest import gone

LORA = LoRAConfig(rank=8, alpha=16)
_ADAPTER = re.compile(r"/\.step-000001\.tmp-[0-9a-f]+/adapter/adapter_model\.safetensors$")


def busy_processes(n: int = 2) -> list[subprocess.Popen]:
    """``n`` processes that spin on the CPU at the default nice value; kill them when done."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def orphan_seconds(model: nn.Module, base: Path, out: Path, inside_call: bool, moment: float = 0.0, limit: float = 120.0) -> float:
    """Fork a trainer that submits one save of ``model`` to a forked writer; SIGKILL it (once the writer
    is inside the long call, or ``moment`` s after the writer started); seconds until the writer is gone
    (``limit`` if it is still there then; it is killed)."""
    ours, theirs = os.pipe()
    trainer = os.fork()
    if trainer == 0:
        os.close(ours)
        _trainer(model, base, out, inside_call, theirs)
    os.close(theirs)
    writer = None
    try:
        with os.fdopen(ours) as pipe:
            writer = int(_line(pipe, limit))
            if inside_call:
                assert _line(pipe, limit) == "inside", "the writer never reached the long call"
                computed = _cpu_seconds(writer)
                while _cpu_seconds(writer) < computed + 0.05:  # it is inside the call (not between two bytecodes before it)
                    time.sleep(0.01)
            else:
                time.sleep(moment)
            os.kill(trainer, signal.SIGKILL)
            killed = time.monotonic()
            os.waitpid(trainer, 0)
            while not gone(writer, 0) and time.monotonic() - killed < limit:
                time.sleep(0.01)
            return time.monotonic() - killed
    finally:
        for pid in (trainer, writer):
            if pid is not None and not gone(pid, 0):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(trainer, 0)


def _line(pipe, timeout: float) -> str:
    ready, _, _ = select.select([pipe], [], [], timeout)
    assert ready, "the trainer said nothing"
    return pipe.readline().strip()


def _cpu_seconds(pid: int) -> float:
    """The CPU time of process ``pid``, all its threads (the long call may run on a file lane's thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _trainer(model: nn.Module, base: Path, out: Path, inside_call: bool, report: int) -> None:
    """The forked trainer: never returns into the caller's code."""
    try:
        if inside_call:
            _hold_at_the_adapter_fsync(report)
        saver = BackgroundSaver(WriterSpec(base, LORA), CheckpointManager(out), model=model)
        assert saver.kind == WriterKind.FORK
        train_state = {"adapter": {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, "position": {"epoch": 0}}
        saver.submit(1, {"format": "test", "global_step": 1}, SaveOptions(WriteOptions("300KB")), train_state)
        os.write(report, f"{saver.writer.pid}\n".encode())
        time.sleep(600)  # until killed
    finally:
        os._exit(0)


def _hold_at_the_adapter_fsync(report: int) -> None:
    """In the writer (forked from here, so it inherits this), the fsync of step 1's adapter first runs
    one C call of minutes that releases the GIL and never returns to Python for a signal."""
    fsync = os.fsync

    def held(fd: int) -> None:
        if _ADAPTER.search(os.readlink(f"/proc/self/fd/{fd}")):
            os.write(report, b"inside\n")
            hashlib.pbkdf2_hmac("sha256", b"slimtune", b"writer", 2**31 - 1)
        fsync(fd)

    os.fsync = held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30, help="kills of each kind (inside a long call, at a random moment)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    from slimtune.model import load_qlora_model
    from slimtune.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="writer-lifetime-") as tmp:
        base = make_tiny_checkpoint(Path(tmp) / "base", seed=1, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
        model = load_qlora_model(base, LORA, seed=0, progress=False)
        spinners = busy_processes(2)
        try:
            for inside_call in (True, False):
                figures = []
                for i in range(args.kills):
                    moment = 0.0 if inside_call else rng.uniform(0.0, 3.0)
                    figures.append(orphan_seconds(model, base, Path(tmp) / f"run-{inside_call}-{i}", inside_call, moment))
                    print(f"{'inside a long C call' if inside_call else f'at {moment:.2f} s'}: gone {figures[-1]:.2f} s after its trainer")
                what = "inside a long C call" if inside_call else "at random moments of the save"
                print(f"{what}: worst {max(figures):.2f} s, median {sorted(figures)[len(figures) // 2]:.2f} s of {len(figures)} kills")
        finally:
            for p in spinners:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
