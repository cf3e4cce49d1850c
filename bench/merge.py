"""``python -m bench merge``: the offline merge (``slimtune merge``'s code path) of a synthetic base + adapter
written under ``--out`` once, in a fresh child process (bench/merge_child.py) that reports its own peak
RSS, bytes read and written, and seconds per stage."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import child_env, disk_write_mb_s, run_child, synthetic_base_and_adapter
from bench.floors import floors, ratio_floor


def merge_in_child(base: Path, adapter: Path, merged: Path, device: str = "cpu", verify: bool = True) -> dict:
    """``slimtune merge``'s code path (merge_from_files) in a fresh child process: its figures (bench/merge_child.py)."""
    return run_child("bench.merge_child", str(base), str(adapter), str(merged), device, "verify" if verify else "no-verify", what="merge")


def bench_merge(preset: str, out: Path, layers: int | None = None, device: str = "cpu", verify: bool = True) -> dict:
    """Synthetic base + adapter on disk (made once, reused), then the merge in a fresh child process,
    (with ``verify``, as ``slimtune merge`` by default, the base's sha256 pass beside it), which reports
    its own peak RSS (VmHWM of its whole life: interpreter, imports, merge), the figure
    /usr/bin/time -v reports. ``floors`` (bench/floors.py, after the merge): the cold O_DIRECT read of
    the base, the O_DIRECT write of the output's size, the CPU floor; ``ratio_floor`` = the run's floor / ``merge_s``.
    (The parent's ru_maxrss for children is not used: the kernel folds the
    parent's own high-water mark into it when the child is started with vfork.)"""

    tag, base, adapter = synthetic_base_and_adapter(preset, out, layers)
    merged = out / f"merged-{tag}"
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    stats = merge_in_child(base, adapter, merged, device, verify)
    write_mb_s = stats["bytes_written"] / stats["merge_s"] / 1e6
    shutil.rmtree(merged, ignore_errors=True)
    output = stats["output_bytes"]
    floor = floors(sorted(base.glob("*.safetensors")), out, output, hashed_bytes=output, verify_bytes=base_bytes)
    return {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "base_bytes": base_bytes,
        "output_bytes": stats["output_bytes"],
        "bytes_read": stats["bytes_read"],
        "bytes_written": stats["bytes_written"],
        "merge_s": round(stats["merge_s"], 3),
        "write_mb_s": round(write_mb_s, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(write_mb_s / disk, 3),
        "peak_rss_mb": round(stats["peak_rss_mb"], 1),
        "device": device,
        "verify": verify,
        "stages_s": stats["stages_s"],
        "floors": floor,
        "ratio_floor": ratio_floor(floor, stats["merge_s"], verify),
        "ratio_floor_both": ratio_floor(floor, stats["merge_s"], verify, both=True),
    }


def evict(*directories: Path) -> None:
    """Drop the files under ``directories`` from the page cache: ``sync``, then
    posix_fadvise(POSIX_FADV_DONTNEED) on each (works without root; /proc/sys/vm/drop_caches may be
    refused or, in a container, accepted and ignored)."""
    os.sync()
    for d in directories:
        for p in Path(d).rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _timed(cmd: list[str], what: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{what} failed with exit code {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return seconds


def bench_merge_cold(preset: str, out: Path, layers: int | None = None, rounds: int = 2) -> dict:
    """The offline merge at copy speed: with the base evicted from the page cache (``evict``) before each
    run, ``cp -r BASE DST && sync`` vs ``slimtune merge`` (a fresh CLI process, default sha256 check, then
    ``--no-verify``), alternated ``rounds`` times in one run; then one cold run of each merge in the
    stage-timing child (bench/merge_child.py) for the stage table. ratio = copy seconds / merge seconds
    (>= 1: the merge is at least as fast as copying the base). ``floors`` (bench/floors.py): the cold
    O_DIRECT read of the base, the O_DIRECT write of the output's size, the CPU floor; ``ratio_floor`` and
    ``ratio_floor_no_verify``: each mode's floor / its median CLI merge seconds."""
    tag, base, adapter = synthetic_base_and_adapter(preset, out, layers)
    dst = out / f"cold-{tag}"
    base_bytes = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    merge = [sys.executable, "-m", "slimtune", "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(dst)]
    runs = {
        "copy": ["sh", "-c", f'cp -r "{base}" "{dst}" && sync'],
        "merge": merge,
        "merge_no_verify": [*merge, "--no-verify"],
    }
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, cmd in runs.items():
            shutil.rmtree(dst, ignore_errors=True)
            evict(base, adapter)
            seconds[name].append(round(_timed(cmd, name), 3))
    stages = {}
    for verify in (True, False):
        shutil.rmtree(dst, ignore_errors=True)
        evict(base, adapter)
        child = merge_in_child(base, adapter, dst, "cpu", verify)
        figures = {"merge_s": round(child["merge_s"], 3), "bytes_read": child["bytes_read"], **child["stages_s"]}
        stages["verify" if verify else "no_verify"] = figures
    output = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    shutil.rmtree(dst, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    weights = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    floor = floors(sorted(base.glob("*.safetensors")), out, output, hashed_bytes=output, verify_bytes=weights)
    return {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "base_bytes": base_bytes,
        "evict": "posix_fadvise(POSIX_FADV_DONTNEED) after sync",
        "seconds": seconds,
        "ratio_merge": round(med["copy"] / med["merge"], 3),
        "ratio_merge_no_verify": round(med["copy"] / med["merge_no_verify"], 3),
        "stages_s": stages,
        "floors": floor,
        "ratio_floor": ratio_floor(floor, med["merge"]),
        "ratio_floor_no_verify": ratio_floor(floor, med["merge_no_verify"], verify=False),
        "ratio_floor_both": ratio_floor(floor, med["merge"], both=True),
        "ratio_floor_both_no_verify": ratio_floor(floor, med["merge_no_verify"], verify=False, both=True),
    }
