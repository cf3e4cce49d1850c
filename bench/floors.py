"""The floors a streaming bench (``gguf``, ``save``, ``merge``) is judged against, measured in the same run:
the cold read of the base at O_DIRECT speed, the O_DIRECT write of a file the size of the output, and the
CPU floor (one core's time to hash, and to quantize, a sample, scaled to the whole job and divided by the
cores the job may use). The floor is the largest; ``ratio_floor = floor_s / job seconds`` (1.0: the job
runs at the floor). One helper per job: ``direct_read_s``, ``direct_write_s``, ``hash_core_s``,
``quantize_core_s``; ``floors`` puts them together.

A job that reads a base and writes a file does both through one disk. Where the disk serves reads and
writes from one budget (this VM's does: docs/benchmarks.md), the largest of the two is no time a job
can reach; ``read_and_write_s`` measures the read and the write at once, in two threads, and
``floor_both_s`` (the largest of it and the CPU floor) is the job's floor on the disk as it is. Both
floors are printed; ``ratio_floor`` keeps the largest-of-the-three definition.

Example::

    f = floors(base_files, out, output_bytes, hashed_bytes=output_bytes, verify_bytes=base_bytes)
    ratio_floor(f, export_s), ratio_floor(f, export_s, verify=False)
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from pathlib import Path

from bench.common import disk_direct_write_mb_s
from slimtune.runtime import usable_cores

_BLOCK = 8 * 1024 * 1024
_HASH_SAMPLE = 256 * 1024 * 1024
_QUANT_ROWS, _QUANT_COLS = 256, 4096
_MAIN_TYPE = {"q4_k_m": "Q4_K", "q4_k_s": "Q4_K", "q5_k_m": "Q5_K", "q5_k_s": "Q5_K", "q6_k": "Q6_K", "q2_k": "Q2_K"}
_MAIN_TYPE |= {"q3_k_s": "Q3_K", "q3_k_m": "Q3_K", "q3_k_l": "Q3_K"}


def direct_read_s(paths: list[Path]) -> float | None:
    """Seconds to read every file in ``paths`` once with O_DIRECT (past the page cache: a cold read
    whatever the cache holds), 8 MB at a time; None where the platform or filesystem refuses O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    start = time.perf_counter()
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | flag)
            try:
                pos = 0
                while n := os.preadv(fd, [buf], pos):
                    pos += n
            finally:
                os.close(fd)
    except OSError:  # EINVAL: a filesystem without O_DIRECT
        return None
    finally:
        buf.close()
    return time.perf_counter() - start


def read_and_write_s(paths: list[Path], directory: Path, nbytes: int) -> float | None:
    """Seconds for the O_DIRECT read of every file in ``paths`` (``direct_read_s``) and the O_DIRECT write
    of ``nbytes`` under ``directory`` (``direct_write_s``) run at the same time, in two threads, until both
    end: what one disk takes for a job that reads the one and writes the other. None where either refuses."""
    results: dict[str, float | None] = {}
    jobs = {"read": lambda: direct_read_s(paths), "write": lambda: direct_write_s(directory, nbytes)}
    threads = [threading.Thread(target=lambda k=k, job=job: results.__setitem__(k, job())) for k, job in jobs.items()]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return None if None in (results.get("read"), results.get("write")) else seconds


def direct_write_s(directory: Path, nbytes: int) -> float | None:
    """Seconds to write ``nbytes`` with O_DIRECT and fsync under ``directory`` (``disk_direct_write_mb_s``)."""
    mb_s = disk_direct_write_mb_s(directory, nbytes) if nbytes else None
    return None if mb_s is None else nbytes / (mb_s * 1e6)


def hash_core_s(nbytes: int) -> float:
    """One core's seconds to sha256 ``nbytes``: a sample of at most 256 MB hashed, scaled."""
    sample = min(max(nbytes, _BLOCK), _HASH_SAMPLE)
    block = os.urandom(_BLOCK)
    h = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(sample // _BLOCK):
        h.update(block)
    return (time.perf_counter() - start) * nbytes / (sample // _BLOCK * _BLOCK)


def quantize_core_s(qtype: str, values: int) -> float | None:
    """One core's seconds to quantize ``values`` to ``qtype`` (an export --type; a mix at its main block
    type): 256 rows of 4096 Gaussian values (std 0.02) stored as bf16, as the base stores them and the
    export hands its untouched tensors to the quantizer, quantized as the export calls it
    (``Quantizer.submit``, NaN check on) with one thread, the best of 3, scaled. None for the
    float types (f32, f16, bf16: a cast, not a quantizer)."""
    import torch

    from slimtune.gguf import ggml

    name = _MAIN_TYPE.get(qtype, qtype.upper())
    if name in ("F32", "F16", "BF16"):
        return None
    rows = (torch.randn(_QUANT_ROWS, _QUANT_COLS, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    with ggml.Quantizer(1) as quantizer:  # the export's call, on one thread
        quantizer.submit(rows[:1], name, finite=True)()  # the native loop built or loaded before the clock
        best = float("inf")
        for _ in range(3):  # the best of 3: one submission is milliseconds
            start = time.perf_counter()
            quantizer.submit(rows, name, finite=True)()
            best = min(best, time.perf_counter() - start)
        return best * values / rows.numel()


def floors(
    base_files: list[Path] | None,
    out: Path,
    output_bytes: int,
    hashed_bytes: int = 0,
    verify_bytes: int = 0,
    quantize: tuple[str, int] | None = None,
) -> dict:
    """The floors of one job: ``base_files`` read (None: the job reads no base, as a live model's save),
    ``output_bytes`` written under ``out``, ``hashed_bytes`` hashed in any case (the written checkpoint),
    ``verify_bytes`` more with the hash check (the base), ``quantize``: (type, values) quantized. Seconds:
    ``read_s``, ``write_s``, one core's ``hash_core_s`` and ``quantize_core_s``, ``cores``, the CPU floor
    with and without the check (``cpu_s``, ``cpu_no_verify_s``), and ``floor_s`` / ``floor_no_verify_s``,
    the largest of read, write and CPU; with a base read and a file written, ``read_and_write_s`` (both
    at once) and ``floor_both_s`` / ``floor_both_no_verify_s``, the largest of that and the CPU."""
    cores = usable_cores()
    read = direct_read_s(base_files) if base_files else None
    write = direct_write_s(out, output_bytes)
    hash_s = hash_core_s(hashed_bytes + verify_bytes) if hashed_bytes + verify_bytes else 0.0
    quant = quantize_core_s(*quantize) if quantize else None
    plain_hash = hash_s * hashed_bytes / (hashed_bytes + verify_bytes) if hashed_bytes + verify_bytes else 0.0
    cpu = (hash_s + (quant or 0.0)) / cores
    cpu_plain = (plain_hash + (quant or 0.0)) / cores
    disk = [s for s in (read, write) if s is not None]
    both = read_and_write_s(base_files, out, output_bytes) if base_files and output_bytes else None
    shared = {}
    if both is not None:
        shared = {
            "read_and_write_s": round(both, 3),
            "floor_both_s": round(max(cpu, both), 3),
            "floor_both_no_verify_s": round(max(cpu_plain, both), 3),
        }
    return {
        "read_s": None if read is None else round(read, 3),
        "write_s": None if write is None else round(write, 3),
        "hash_core_s": round(hash_s, 3),
        "quantize_core_s": None if quant is None else round(quant, 3),
        "cores": cores,
        "cpu_s": round(cpu, 3),
        "cpu_no_verify_s": round(cpu_plain, 3),
        "floor_s": round(max([cpu, *disk]), 3),
        "floor_no_verify_s": round(max([cpu_plain, *disk]), 3),
        **shared,
    }


def ratio_floor(figures: dict, seconds: float, verify: bool = True, both: bool = False) -> float | None:
    """``floor_s / seconds`` of a job run with the hash check (``verify``) or without; with ``both``, the
    floor of the read and the write at once (``floor_both_s``; None where it was not measured)."""
    key = ("floor_both_s" if verify else "floor_both_no_verify_s") if both else ("floor_s" if verify else "floor_no_verify_s")
    return round(figures[key] / seconds, 3) if key in figures else None
