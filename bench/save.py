"""``python -m bench save``: the merged save of a synthetic QLoRA model in this process (peak RSS over its RSS
before, bytes written, seconds against the disk's own speed; when slower than the disk, one more save timed
by stage; its floors, bench/floors.py: the O_DIRECT write of the output's size and one core's hashing of it
over the usable cores, ``ratio_floor`` = floor / save seconds; ``stages_s``: one more save timed by stage).
``python -m bench dist-save`` (``--nproc 2``): the cooperative export by 2 gloo ranks of an
FSDP2-sharded model next to the single-process save of the same model (torchtune's way beside it:
bench/peers/fsdp_gather_merge.py)."""

from __future__ import annotations

import multiprocessing
import queue
import shutil
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import disk_write_mb_s
from bench.floors import floors, ratio_floor
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.distributed import current_ranks, shard_model
from slimtune.formats.manifest import read_manifest
from slimtune.formats.safetensors import read_header
from slimtune.memory import DEFAULT_SHARD_SIZE, bytes_read_by_process, bytes_written_by_process, peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.profiler import timing_stages
from slimtune.synthetic import preset_config, synthetic_qlora_model

Peer = Callable[[torch.nn.Module, object], dict]  # measured on every rank after the export: bench/peers/fsdp_gather_merge.py


def _measured_save(model: torch.nn.Module, target: Path, options: WriteOptions) -> tuple:
    """``save_checkpoint`` measured in this process: (result, RSS before MB, peak RSS MB with VmHWM reset
    first, bytes written by write())."""
    before = rss_mb()
    reset_peak_rss()
    w0 = bytes_written_by_process()
    result = save_checkpoint(model, target, options)
    written = bytes_written_by_process() - w0
    return result, before, peak_rss_mb(), written


def bench_save(preset: str, out: Path, layers: int | None = None, device: str = "cpu") -> dict:
    overrides = {"num_hidden_layers": layers} if layers else {}
    config = preset_config(preset, **overrides)
    model = synthetic_qlora_model(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"save-{preset}"
    shutil.rmtree(target, ignore_errors=True)
    merged_bytes = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) * 2
    disk = disk_write_mb_s(out, min(merged_bytes, 2 * 1024**3))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        vram_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    result, before, peak, written = _measured_save(model, target, WriteOptions(progress=True))
    vram = {"vram_overhead_mb": round((torch.cuda.max_memory_allocated() - vram_before) / 2**20, 1)} if cuda else {}
    output_bytes = result.total_bytes + (target / "slimtune_manifest.json").stat().st_size
    write_mb_s = output_bytes / result.seconds / 1e6
    vram["stages_s"] = _save_stages(model, target, cuda)  # where the time goes, from one more save timed by stage
    keys = Counter(k.split(".")[0] for f in sorted(target.glob("*.safetensors")) for k in read_header(f).tensors)
    floor = floors(None, out, output_bytes, hashed_bytes=result.total_bytes)  # the base is the model in memory
    return {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "params": params,
        "output_bytes": output_bytes,
        "bytes_written": written,
        "save_s": round(result.seconds, 3),
        "write_mb_s": round(write_mb_s, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(write_mb_s / disk, 3),
        "rss_before_mb": round(before, 1),
        "peak_rss_mb": round(peak, 1),
        "overhead_mb": round(peak - before, 1),
        "device": device,
        "tensors_by_prefix": dict(sorted(keys.items())),  # a vision model's tower ("visual") is saved whole beside the rest
        **vram,
        "floors": floor,
        "ratio_floor": ratio_floor(floor, result.seconds),
    }


def _save_stages(model: torch.nn.Module, target: Path, cuda: bool) -> dict:
    """Seconds per stage of a second save of the same model (producer: dequantize, merge, device_to_host;
    writer threads: copy, write, hash, fsync; they overlap), each summed over its threads, then under
    ``wall`` the wall time each stage had at least one thread in it, and that save's own seconds (on a GPU it synchronises
    at every stage edge, so it runs slower than the plain save it explains)."""
    shutil.rmtree(target, ignore_errors=True)
    with timing_stages(cuda_sync=cuda) as clock:
        timed = save_checkpoint(model, target, WriteOptions(progress=False))
    return {
        **{k: round(v, 3) for k, v in sorted(clock.seconds.items())},
        "wall": {k: round(v, 3) for k, v in sorted(clock.wall().items())},  # the time at least one thread was in each stage
        "timed_save_s": round(timed.seconds, 3),
    }


def _free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_rank(
    rank: int, nproc: int, port: int, model: torch.nn.Module, target: Path, peer: Peer | None, max_shard_size: str, results
) -> None:
    """One forked rank: join, shard, export (and optionally the peer's gather + merge); report figures."""

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
        ranks = current_ranks()
        shard_model(model, ranks)
        before = rss_mb()
        reset_peak_rss()
        w0, r0 = bytes_written_by_process(), bytes_read_by_process()
        result = save_checkpoint(model, target, WriteOptions(max_shard_size, progress=False), ranks)
        row = {
            "rank": rank,
            "rss_before_mb": round(before, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "overhead_mb": round(peak_rss_mb() - before, 1),
            "bytes_written": bytes_written_by_process() - w0,
            "bytes_read": bytes_read_by_process() - r0,
            "export_s": round(result.seconds, 3),
        }
        if peer is not None:
            row["peer"] = peer(model, ranks)
        results.put(row)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the bench
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def dist_export(
    model: torch.nn.Module, target: Path, nproc: int = 2, max_shard_size: str = DEFAULT_SHARD_SIZE, peer: Peer | None = None
) -> list[dict]:
    """The cooperative export of ``model`` to ``target`` by ``nproc`` forked ranks (the model shared
    copy-on-write): each joins a gloo group, FSDP2-shards the model (``shard_model``: it copies its rows
    of every weight) and calls ``save_checkpoint`` with its ``Ranks``. Returns one row per rank, in rank
    order, measured in that rank: RSS before the save, peak RSS (VmHWM, reset before the save) and its
    difference, bytes written and read back, seconds (and, with ``peer``, what ``peer(model, ranks)``
    measured on every rank after the export: bench/peers/fsdp_gather_merge.py).
    Example: ``rows = dist_export(synthetic_qlora_model(preset_config("tiny")), Path("out/x"))``"""

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dist_rank, args=(r, nproc, port, model, target, peer, max_shard_size, results)) for r in range(nproc)]
    for p in procs:
        p.start()
    rows: list[dict] = []
    while len(rows) < nproc:
        try:
            rows.append(results.get(timeout=2))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:  # killed (OOM, signal) before it could report: stop the others too
                for p in procs:
                    p.kill()
                raise SystemExit(f"dist-save: rank(s) {dead} died with exit code(s) {[procs[r].exitcode for r in dead]}") from None
    rows.sort(key=lambda r: r["rank"])
    for p in procs:
        p.join()
    failed = [r for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"dist-save: {failed}")
    return rows


def bench_dist_save(preset: str, out: Path, nproc: int = 2, layers: int | None = None, peer: Peer | None = None) -> dict:
    """The cooperative export by ``nproc`` ranks next to the single-process save of the same model, in
    one run, with the disk's fsync'd write speed measured in the same run. The synthetic model is built
    once here and saved by this process; then ``nproc`` ranks are forked (the model shared copy-on-
    write), join a gloo group, FSDP2-shard it (``shard_model``: each rank copies its rows of every
    weight) and export it together. Each rank measures its own RSS (before; VmHWM reset) and its
    write()/read() byte counters (reads = the sha256 read-back of files it did not write whole)."""

    overrides = {"num_hidden_layers": layers} if layers else {}
    config = preset_config(preset, **overrides)
    model = synthetic_qlora_model(config)
    out.mkdir(parents=True, exist_ok=True)
    single_dir, dist_dir = out / f"dist-save-single-{preset}", out / f"dist-save-{nproc}r-{preset}"
    for d in (single_dir, dist_dir):
        shutil.rmtree(d, ignore_errors=True)
    merged_bytes = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) * 2
    disk = disk_write_mb_s(out, min(merged_bytes, 2 * 1024**3))

    single, before, single_peak, single_written = _measured_save(model, single_dir, WriteOptions(progress=False))
    single_manifest = read_manifest(single_dir)["files"]
    single_bytes = single.total_bytes + (single_dir / "slimtune_manifest.json").stat().st_size
    shutil.rmtree(single_dir)

    rows = dist_export(model, dist_dir, nproc, peer=peer)
    manifest = read_manifest(dist_dir)["files"]
    output_bytes = sum(f["size"] for f in manifest) + (dist_dir / "slimtune_manifest.json").stat().st_size
    shutil.rmtree(dist_dir)
    seconds = rows[0]["export_s"]  # the coordinator's: from the plan to the rename, after every rank's fsync
    written = sum(r["bytes_written"] for r in rows)
    result = {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "nproc": nproc,
        "output_bytes": output_bytes,
        "bytes_written": written,
        "written_over_output": round(written / output_bytes, 4),
        "bytes_read_back": [r["bytes_read"] for r in rows],
        "export_s": seconds,
        "write_mb_s": round(output_bytes / seconds / 1e6, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(output_bytes / seconds / 1e6 / disk, 3),
        "ranks": [{k: r[k] for k in ("rank", "rss_before_mb", "peak_rss_mb", "overhead_mb")} for r in rows],
        "max_overhead_mb": max(r["overhead_mb"] for r in rows),
        "identical_to_single": manifest == single_manifest,
        "single": {
            "save_s": round(single.seconds, 3),
            "write_mb_s": round(single_bytes / single.seconds / 1e6, 1),
            "ratio": round(single_bytes / single.seconds / 1e6 / disk, 3),
            "bytes_written": single_written,
            "rss_before_mb": round(before, 1),
            "peak_rss_mb": round(single_peak, 1),
            "overhead_mb": round(single_peak - before, 1),
        },
    }
    if peer is not None:
        result["peer_rank0"] = rows[0]["peer"]
    return result
