"""The child of ``python -m bench.gpu_check colab`` and ``python -m bench seed``: ``python -m bench.colab_child
KEY=VALUE ...`` runs the recipe with the shipped llama3-8b_qlora config and those overrides, and prints one
line ``RESULT {json}``: steps, losses, the host's peak RSS (of this whole process), peak VRAM, the last
save's seconds and bytes, the peak RSS during that save, and ``phases``: the RSS of each step of the run
(``PhaseMemory``)."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import time

from slimtune.config import load_config
from slimtune.memory import peak_rss_mb, rss_mb

_MB = 1024.0


def _status() -> dict[str, float]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")))
    return {k: int(v.split()[0]) / _MB for k, v in fields.items()}


class PhaseMemory:
    """RSS per named phase of the run: a thread samples /proc/self/status every ``every_s`` and keeps, for the
    innermost phase running, the largest VmRSS and its anonymous / file-backed parts; at each phase's end VmHWM
    (when it rose during the phase) makes its peak exact however short the spike. Phases nest (``with
    memory.phase("save/stream")``); ``wrap(obj, attr, name)`` makes a function a phase."""

    def __init__(self, every_s: float = 0.01):
        self.rows: dict[str, dict] = {}
        self._stack: list[str] = ["start"]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _row(self, name: str) -> dict:
        return self.rows.setdefault(name, {"calls": 0, "rss_start_mb": rss_mb(), "peak_mb": 0.0, "anon_mb": 0.0, "file_mb": 0.0})

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            s = _status()
            with self._lock:
                row = self._row(self._stack[-1])
                row["peak_mb"] = max(row["peak_mb"], s["VmRSS"])
                row["anon_mb"] = max(row["anon_mb"], s["RssAnon"])
                row["file_mb"] = max(row["file_mb"], s["RssFile"] + s.get("RssShmem", 0.0))

    @contextlib.contextmanager
    def phase(self, name: str):
        hwm = peak_rss_mb()
        with self._lock:
            row = self._row(name)
            row["calls"] += 1
            self._stack.append(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            end_hwm, now = peak_rss_mb(), rss_mb()
            with self._lock:
                self._stack.pop()
                row["peak_mb"] = max(row["peak_mb"], now, end_hwm if end_hwm > hwm else 0.0)
                row["rss_end_mb"] = now
                row["seconds_loaded"] = row.get("seconds_loaded", 0.0) + time.perf_counter() - started

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, wrapped)

    def wrap_context(self, obj, attr: str, name: str) -> None:
        """``obj.attr`` a context manager factory: the body of its ``with`` is the phase."""
        factory = getattr(obj, attr)

        @contextlib.contextmanager
        def wrapped(*args, **kwargs):
            with factory(*args, **kwargs), self.phase(name):
                yield

        setattr(obj, attr, wrapped)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {k: {f: round(v, 1) if isinstance(v, float) else v for f, v in row.items()} for k, row in self.rows.items()}


def _traced() -> PhaseMemory:
    """The recipe's steps (and the save's parts) as phases, wrapped where the recipe looks them up."""
    from slimtune.checkpoint import extras, manager, save
    from slimtune.recipes import finetune, run_steps, train_loop
    from slimtune.recipes.objectives import sft

    memory = PhaseMemory()
    for attr, name in [  # the shared set-up steps, looked up in recipes/run_steps.py by run_steps.prepare
        ("read_data", "setup/data"),
        ("load_model", "setup/load"),
        ("make_optimization", "setup/optimizer"),
    ]:
        memory.wrap(run_steps, attr, name)
    for attr, name in [
        ("restore", "restore (docs staging)"),
        ("train_step", "train_step"),
        ("evaluate", "evaluate"),
        ("save_step", "save"),
        ("finish", "finish"),
    ]:
        memory.wrap(finetune, attr, name)
    memory.wrap_context(finetune, "merged_forward", "evaluate/eval_loss_merged")
    import torch

    # inside train_step: each micro-batch's backward, its loss, then the step's clip + AdamW + zero_grad
    # (the rest of train_step is the forward passes and the collation)
    memory.wrap(torch.Tensor, "backward", "train_step/backward")
    memory.wrap(sft, "token_loss_sum", "train_step/loss")  # looked up in the SFT objective (its evaluation's calls count here too)
    memory.wrap(train_loop, "apply_gradients", "train_step/clip + AdamW")
    memory.wrap(run_steps, "training_state", "save/training-state snapshot")
    memory.wrap(extras.CheckpointDocs, "files", "save/model card")
    memory.wrap(save, "write_planned", "save/merged + adapter stream")
    memory.wrap(manager, "save_train_state", "save/training state (DCP)")
    return memory


def main(overrides: list[str]) -> None:
    from slimtune.recipes.finetune import run_finetune

    memory = _traced()
    r = run_finetune(load_config("llama3-8b_qlora", overrides))
    phases = memory.close()
    figures = {"steps": r.global_step, "losses": r.losses, "host_peak_rss_mb": r.peak_rss_mb, "peak_vram_mb": r.peak_gpu_mb}
    figures |= {"save_s": r.last_save.seconds, "save_bytes": r.last_save.total_bytes, "peak_rss_during_save_mb": r.peak_rss_last_save_mb}
    figures |= {"vmhwm_at_exit_mb": round(peak_rss_mb(), 1), "phases": phases}
    print("RESULT " + json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
