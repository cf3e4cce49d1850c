"""``python -m bench merge``: the offline merge (``slimtune merge``'s code path) of a synthetic base + adapter
written under ``--out`` once, in a fresh child process (bench/merge_child.py) that reports its own peak
RSS, bytes read and written, and seconds per stage."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.common import disk_write_mb_s, run_child, synthetic_base_and_adapter


def merge_in_child(base: Path, adapter: Path, merged: Path, device: str = "cpu", verify: bool = True) -> dict:
    """``slimtune merge``'s code path (merge_from_files) in a fresh child process: its figures (bench/merge_child.py)."""
    return run_child("bench.merge_child", str(base), str(adapter), str(merged), device, "verify" if verify else "no-verify", what="merge")


def bench_merge(preset: str, out: Path, layers: int | None = None, device: str = "cpu", verify: bool = True) -> dict:
    """Synthetic base + adapter on disk (made once, reused), then the merge in a fresh child process,
    (with ``verify``, as ``slimtune merge`` by default, the base's sha256 pass beside it), which reports
    its own peak RSS (VmHWM of its whole life: interpreter, imports, merge), the figure
    /usr/bin/time -v reports. (The parent's ru_maxrss for children is not used: the kernel folds the
    parent's own high-water mark into it when the child is started with vfork.)"""

    tag, base, adapter = synthetic_base_and_adapter(preset, out, layers)
    merged = out / f"merged-{tag}"
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    stats = merge_in_child(base, adapter, merged, device, verify)
    write_mb_s = stats["bytes_written"] / stats["merge_s"] / 1e6
    shutil.rmtree(merged, ignore_errors=True)
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
    }
