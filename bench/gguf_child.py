"""The child of ``python -m bench gguf``: ``python -m bench.gguf_child BASE ADAPTER OUT TYPE VERIFY`` exports the
GGUF file and prints one JSON line: seconds, bytes written, the export's own report, RSS before (after
imports, those the export makes on first use included: ``imports_mb``) and at peak (reset with clear_refs
first), its CPU seconds (user + system, every thread of this process), and the quantizer's worker
processes' private memory (sampled 4 times a second, summed over the workers alive at each sample; its peak)."""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

from slimtune.formats.merge_source import MergeSource
from slimtune.gguf.export import GGUFOptions, export_gguf
from slimtune.memory import bytes_written_by_process, peak_rss_mb, private_mb, reset_peak_rss, rss_mb


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return pids


class _WorkerMemory(threading.Thread):
    """The peak over samples of the summed private memory of this process's children (the quantizer's
    workers: what they hold beyond the pages they share with this process)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_mb, self.stop = 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.peak_mb = max(self.peak_mb, sum(private_mb(pid) for pid in _children()))


def _warm_imports(base: Path) -> tuple[float, float]:
    """The libraries the export imports on first use (transformers' config classes, its tokenizer
    machinery), imported before the baseline: (RSS they add in MB, seconds). What the export itself holds
    (the tokenizer's data, the metadata, the stream) stays in the measured part; their seconds are added
    to ``export_s`` (the time a user waits for the export, its imports included)."""
    import importlib

    from slimtune.formats.hf import read_model_config

    start, t0 = rss_mb(), time.perf_counter()
    read_model_config(base)  # imports the family's config module (transformers' lazy modules)
    for name in ("transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers", "tokenizers", "jinja2"):
        importlib.import_module(name)
    return rss_mb() - start, time.perf_counter() - t0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
    base, adapter, out, qtype, verify = argv
    imports, imports_s = _warm_imports(Path(base))
    before = rss_mb()
    reset = reset_peak_rss()
    workers = _WorkerMemory()
    workers.start()
    w0, t0, cpu0 = bytes_written_by_process(), time.perf_counter(), _cpu_s()
    result = export_gguf(Path(out), GGUFOptions(qtype, overwrite=True), MergeSource(Path(base), Path(adapter), verify=verify == "True"))
    figures = {"export_s": imports_s + time.perf_counter() - t0, "bytes_written": bytes_written_by_process() - w0}
    figures["cpu_s"] = _cpu_s() - cpu0  # user + system seconds of every thread of this process during the export
    workers.stop.set()
    workers.join()
    figures["workers_private_peak_mb"] = workers.peak_mb
    figures |= {"reported_bytes": result.bytes, "tensors": result.tensors, "rss_before_mb": before, "imports_mb": round(imports, 1)}
    print(json.dumps(figures | {"peak_rss_mb": peak_rss_mb(), "peak_reset": reset}))


if __name__ == "__main__":
    main(sys.argv[1:])
