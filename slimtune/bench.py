"""Benchmarks (not tests): `python -m slimtune.bench save --preset NAME --out DIR` prints one JSON line;
so do `merge`, `nf4`, `load-moe` and `dist-save` (`--nproc 2`: the cooperative export by 2 gloo ranks of
an FSDP2-sharded model next to the single-process save of the same model; torchtune's way beside it:
bench/peers/fsdp_gather_merge.py). This module is the measuring harness and its command line; new
measurements are subcommands here: `train-step --peer peft [--model DIR]` (the recipe's training step
against a PEFT loop, train_bench.py), `train-save` (training with no / synchronous / background saves),
`gguf` (the streamed GGUF export; `--peer llama.cpp`: merge + llama.cpp's convert_hf_to_gguf.py beside it).

The models are synthetic but of the real shape (``slimtune.synthetic``): random NF4 codes and scalers for
every projection, random bf16 for embeddings and norms, LoRA r=8 on q_proj and v_proj. Figures are measured in this process:
peak RSS from VmHWM (reset before the save), bytes written from /proc/self/io wchar, and the disk's own
sequential write speed (with fsync) measured in the same run."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from transformers import MixtralConfig

from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.checkpoint.background import MECHANISM_ENV
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.cli import quiet_library_logs
from slimtune.data import write_jsonl
from slimtune.distributed import current_ranks, shard_model
from slimtune.formats.manifest import read_manifest
from slimtune.memory import DEFAULT_SHARD_SIZE, bytes_read_by_process, bytes_written_by_process, peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.profiler import timing_stages
from slimtune.quant.nf4 import dequantize_nf4_rows, quantize_nf4
from slimtune.synthetic import MIXTRAL_WIDTHS, PRESETS, preset_config, synthetic_qlora_model, write_synthetic_adapter, write_synthetic_base
from slimtune.tiny import byte_tokenizer
from slimtune.train_bench import bench_train_step, print_row

Peer = Callable[[torch.nn.Module, object], dict]  # measured on every rank after the export: bench/peers/fsdp_gather_merge.py


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
    if write_mb_s < disk:  # slower than the disk: where the time goes, from one more save timed by stage
        vram["stages_s"] = _save_stages(model, target, cuda)
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
        **vram,
    }


def _save_stages(model: torch.nn.Module, target: Path, cuda: bool) -> dict:
    """Seconds per stage of a second save of the same model (producer: dequantize, merge, device_to_host;
    writer thread: write, hash, fsync; they overlap) and that save's own seconds (on a GPU it synchronises
    at every stage edge, so it runs slower than the plain save it explains)."""
    shutil.rmtree(target, ignore_errors=True)
    with timing_stages(cuda_sync=cuda) as clock:
        timed = save_checkpoint(model, target, WriteOptions(progress=False))
    return {**{k: round(v, 3) for k, v in sorted(clock.seconds.items())}, "timed_save_s": round(timed.seconds, 3)}


MERGE_CHILD = """
import json, sys, time
from slimtune.checkpoint.writer import WriteOptions
from slimtune.memory import bytes_read_by_process, bytes_written_by_process, peak_rss_mb
from slimtune.merge import merge_from_files
base, adapter, out, device = sys.argv[1:5]
from slimtune.profiler import timing_stages
r0, w0, t0 = bytes_read_by_process(), bytes_written_by_process(), time.perf_counter()
with timing_stages() as clock:  # no synchronisation added: GPU work shows up where the copy to the host waits for it
    result = merge_from_files(base, adapter, out, WriteOptions(overwrite=True, progress=True, device=device))
print(json.dumps({"merge_s": time.perf_counter() - t0, "stages_s": {k: round(v, 3) for k, v in sorted(clock.seconds.items())},
                  "bytes_read": bytes_read_by_process() - r0,
                  "bytes_written": bytes_written_by_process() - w0, "output_bytes": result.total_bytes,
                  "peak_rss_mb": peak_rss_mb()}))
"""


def _synthetic_base_and_adapter(preset: str, out: Path, layers: int | None, vocab: int | None = None) -> tuple[str, Path, Path]:
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


def _merge_in_child(base: Path, adapter: Path, merged: Path, device: str = "cpu") -> dict:
    """``slimtune merge``'s code path (merge_from_files) in a fresh child process: its figures (MERGE_CHILD)."""
    child = subprocess.run(
        [sys.executable, "-c", MERGE_CHILD, str(base), str(adapter), str(merged), device], stdout=subprocess.PIPE, text=True
    )
    if child.returncode:
        raise SystemExit(f"merge failed with exit code {child.returncode}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def bench_merge(preset: str, out: Path, layers: int | None = None, device: str = "cpu") -> dict:
    """Synthetic base + adapter on disk (made once, reused), then the merge in a fresh child process,
    which reports its own peak RSS (VmHWM of its whole life: interpreter, imports, merge), the figure
    /usr/bin/time -v reports. (The parent's ru_maxrss for children is not used: the kernel folds the
    parent's own high-water mark into it when the child is started with vfork.)"""

    tag, base, adapter = _synthetic_base_and_adapter(preset, out, layers)
    merged = out / f"merged-{tag}"
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    stats = _merge_in_child(base, adapter, merged, device)
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
        "stages_s": stats["stages_s"],
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


LOAD_CHILD = """
import json, sys, time
import slimtune
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from slimtune.quant import is_nf4
before = rss_mb()
reset_peak_rss()
start = time.perf_counter()
model = load_qlora_model(sys.argv[1], LoRAConfig(), progress=False)
seconds = time.perf_counter() - start
peak, after = peak_rss_mb(), rss_mb()
def nbytes(p):
    if is_nf4(p):
        return sum(t.numel() * t.element_size() for t in (p.quantized_data, p.quantized_scalers, p.quantization_factor))
    return p.numel() * p.element_size()
resident = sum(nbytes(p) for p in model.parameters()) / 2**20
experts = [m for m in model.modules() if type(m).__name__ == "NF4Experts"]
largest = max(p.numel() * 2 for m in experts for p in m.pieces.values()) / 2**20
print(json.dumps(dict(load_s=seconds, rss_before_mb=before, peak_rss_mb=peak, rss_after_mb=after, model_mb=resident,
                      largest_expert_tensor_bf16_mb=largest, expert_pieces=sum(len(m.pieces) for m in experts))))
"""


def bench_load_moe(out: Path, layers: int = 2) -> dict:
    """Load a synthetic Mixtral of the real widths (hidden 4096, intermediate 14336, 8 experts; per-expert
    tensors as published) as QLoRA in a fresh child process; its peak RSS during the load against what
    it holds afterwards (the bound: at most the resident NF4 model + 512 MB)."""

    config = MixtralConfig(**MIXTRAL_WIDTHS, num_hidden_layers=layers, dtype="bfloat16")
    base = out / f"mixtral-{layers}l"
    if not is_complete_checkpoint(base):
        write_synthetic_base(config, base)
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    child = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(base)], stdout=subprocess.PIPE, text=True)
    if child.returncode:
        raise SystemExit(f"load failed with exit code {child.returncode}")
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    return {
        "model": f"mixtral widths, {layers} layers",
        "base_bytes": base_bytes,
        **{k: round(v, 1) if isinstance(v, float) else v for k, v in stats.items()},
        "peak_over_after_mb": round(stats["peak_rss_mb"] - stats["rss_after_mb"], 1),
        "bound_mb": round(stats["rss_after_mb"] + 512, 1),
        "within_bound": stats["peak_rss_mb"] <= stats["rss_after_mb"] + 512,
    }


def bench_nf4(rows: int = 4096, cols: int = 14336, chunk_rows: int = 256, repeats: int = 3, device: str = "cpu") -> dict:
    """NF4 dequantization throughput: torchao's get_original_weight vs slimtune's row-chunked table
    lookup (as a save calls it) and the same lookup in one call (as ``nf4_linear`` calls it in training),
    on one weight (Llama-3-8B's MLP shape by default); bit-identity checked in the same run. On a GPU the
    chunked figure includes ~8 kernel launches per chunk, which the whole-tensor figure separates out."""

    weight = quantize_nf4((torch.randn(rows, cols, device=device) * 0.02).to(torch.bfloat16))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    reference = weight.get_original_weight()
    chunks = [dequantize_nf4_rows(weight, s, min(s + chunk_rows, rows)) for s in range(0, rows, chunk_rows)]
    identical = torch.equal(torch.cat(chunks).view(torch.int16), reference.view(torch.int16))
    del reference, chunks
    torchao_s = best(weight.get_original_weight)

    def chunked() -> None:  # as the save consumes it: one chunk at a time
        for s in range(0, rows, chunk_rows):
            dequantize_nf4_rows(weight, s, min(s + chunk_rows, rows))

    ours_s = best(chunked)
    whole_s = best(lambda: dequantize_nf4_rows(weight, 0, rows))  # one call: what nf4_linear does in training
    params = rows * cols
    return {
        "shape": [rows, cols],
        "device": device,
        "threads": torch.get_num_threads(),
        "torchao_mparams_s": round(params / torchao_s / 1e6, 1),
        "slimtune_mparams_s": round(params / ours_s / 1e6, 1),
        "speedup": round(torchao_s / ours_s, 2),
        "chunk_rows": chunk_rows,
        "slimtune_whole_mparams_s": round(params / whole_s / 1e6, 1),
        "whole_speedup": round(torchao_s / whole_s, 2),
        "bit_identical": identical,
    }


def synthetic_train_base(out: Path, preset: str, layers: int | None = None) -> Path:
    """A random bf16 checkpoint of the preset's shape (``layers`` of them) with the byte-level tokenizer,
    written once, where ``merge`` looks for its base (``base-PRESET[-Nl]``): train-step, gpu_check."""
    target = out / f"base-{preset}" if layers is None else out / f"base-{preset}-{layers}l"
    if not is_complete_checkpoint(target):
        write_synthetic_base(preset_config(preset, **({"num_hidden_layers": layers} if layers else {})), target)
    if not (target / "tokenizer.json").is_file():
        byte_tokenizer().save_pretrained(str(target))
    return target


def _train_step(args: argparse.Namespace) -> None:
    real = args.model is not None
    shape = dict(preset=args.preset, layers=args.layers, steps=args.steps or (8 if real else 6), batch=args.batch or (4 if real else 2))
    shape.update(seq=args.seq or (256 if real else 512), rank=args.rank or (16 if real else 8), real=real)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model if real else synthetic_train_base(args.out, args.preset, args.layers)
    print_row(bench_train_step(model_dir, args.out, shape, rounds=args.rounds, compile=args.compile, threads=args.threads))


TRAIN_SAVE_MODES = ("nosave", "sync", "async", "process", "thread")
# async: checkpoint.async as it is (on the CPU a writer forked at each save point); process: the writer
# process that rebuilds the model from the base files (what a GPU run uses); thread: the rebuilding
# writer in the trainer's process (GIL). The last two for the comparison of mechanisms.
_BACKGROUND = ("async", "process", "thread")


def _train_save_run(base: Path, data: Path, out: Path, mode: str, steps: int, save_every: int, device: str) -> list[dict]:
    """One recipe run in its own process (its own peak RSS); its metrics records. ``nosave`` saves only
    where the run stops (adapter only, not counted)."""
    saves = [f"checkpoint.save_every_n_steps={save_every}", f"checkpoint.async={mode in _BACKGROUND}"]
    if mode == "nosave":
        saves = ["checkpoint.save_every_n_steps=null", "checkpoint.merged=never", "checkpoint.async=false"]
    args = ["finetune", "--config", "tiny", f"output_dir={out}", f"model.path={base}", "model.create_tiny=false"]
    args += [f"dataset.path={data}", "dataset.create_builtin=false", "dataset.max_seq_len=64", "training.batch_size=1"]
    args += [f"training.max_steps={steps}", "training.total_epochs=1", "checkpoint.keep_last_n=null", "checkpoint.max_shard_size=2GB"]
    args += [f"device={device}", "logging.progress_bar=false", *saves]
    env = {k: v for k, v in os.environ.items() if k != MECHANISM_ENV} | ({MECHANISM_ENV: mode} if mode in ("process", "thread") else {})
    proc = subprocess.run([sys.executable, "-m", "slimtune", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"train-save {mode}: {proc.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run_figures(rows: list[dict], mode: str) -> dict:
    """The training loop's time (steps plus ``blocked_s``: time blocked by saves, the final wait for the
    last background save included), stalls, save durations, throughput of steps during and outside a
    background save, peak RSS."""
    counted = [r for r in rows if mode != "nosave" or "checkpoint" not in r]
    stalls = [r["checkpoint_stall_s"] for r in counted if "checkpoint_stall_s" in r]
    blocked_s = sum(stalls) + sum(r.get("checkpoint_final_wait_s", 0.0) for r in rows)
    run_s = sum(r["step_s"] for r in rows) + blocked_s
    saves = [r["checkpoint_save_s"] for r in rows if "checkpoint_save_s" in r]
    saves += [a["checkpoint_save_s"] for r in rows for a in r.get("checkpoint_also_saved", [])]
    during = [r["tokens_per_s"] for r in rows if r.get("checkpoint_in_flight")]
    outside = [r["tokens_per_s"] for r in rows if not r.get("checkpoint_in_flight")]
    figures = {"run_s": round(run_s, 2), "blocked_s": round(blocked_s, 2), "peak_rss_mb": round(rows[-1]["peak_rss_mb"], 1)}
    if mode != "nosave":
        figures.update(stall_s=[round(s, 3) for s in stalls], save_s=[round(s, 2) for s in saves])
    if mode in _BACKGROUND:
        figures["writer_private_mb"] = round(max(r["checkpoint_writer_private_mb"] for r in rows if "checkpoint_writer_private_mb" in r), 1)
        figures["writer_peak_rss_mb"] = round(max(r["checkpoint_peak_rss_mb"] for r in rows if "checkpoint_peak_rss_mb" in r), 1)
        figures["snapshot_mb"] = round(max(r.get("checkpoint_snapshot_bytes", 0) for r in rows) / 2**20, 1)
        figures["tokens_per_s_during_save"] = round(statistics.mean(during), 1) if during else None
        figures["tokens_per_s_outside_save"] = round(statistics.mean(outside), 1) if outside else None
    return figures


def _same_checkpoints(a: Path, b: Path) -> bool:
    """Every step-N of two runs: the same files with the same sha256 (manifests), but the recipe state and
    DCP's .metadata, which every save stamps afresh (step timings; a uuid and a temporary path): those
    compared by content."""
    fresh = {"recipe_state.pt", "train_state/.metadata"}
    steps = sorted(p.name for p in a.glob("step-*"))
    if not steps or steps != sorted(p.name for p in b.glob("step-*")):
        return False
    for step in steps:
        fa, fb = ({f["path"]: f["sha256"] for f in read_manifest(d / step)["files"]} for d in (a, b))
        if fa.keys() != fb.keys() or any(fa[k] != fb[k] for k in fa if k not in fresh):
            return False
        meta = [FileSystemReader(str(d / step / "train_state")).read_metadata() for d in (a, b)]
        if (meta[0].state_dict_metadata, meta[0].storage_data) != (meta[1].state_dict_metadata, meta[1].storage_data):
            return False
        states = [torch.load(d / step / "recipe_state.pt", weights_only=True) for d in (a, b)]
        for state in states:
            state["metrics"] = {k: v for k, v in state["metrics"].items() if k not in ("tokens_per_s", "step_s", "checkpoint_stall_s")}
            state["config"] = {k: v for k, v in state["config"].items() if k not in ("output_dir", "checkpoint.async")}
        if states[0] != states[1]:
            return False
    return True


def bench_train_save(preset: str, out: Path, steps: int, save_every: int, layers: int = 2, device: str = "cpu") -> dict:
    """Train a synthetic model of the preset's shape (``layers`` decoder layers) through the recipe five
    times: no saves, synchronous merged saves, background merged saves (``checkpoint.async`` as a run
    gets it: on the CPU a writer forked at each save point), and for the comparison of mechanisms the
    writer process that rebuilds the model from the base files and the same writer as a thread of the
    trainer; one JSON-able dict of figures."""
    config = preset_config(preset, num_hidden_layers=layers)
    base, data = out / f"base-{preset}-{layers}l", out / "train.jsonl"
    if not (base / "config.json").is_file():
        write_synthetic_base(config, base, max_shard_size="2GB")
        byte_tokenizer().save_pretrained(str(base))
    write_jsonl(data, [{"text": f"record {i}: checkpoints stream while training goes on."} for i in range(steps + 1)])
    figures, runs = {}, {}
    modes = [m for m in TRAIN_SAVE_MODES if device == "cpu" or m != "process"]  # off the CPU "async" is that process
    for mode in modes:
        runs[mode] = out / f"run-{mode}"
        shutil.rmtree(runs[mode], ignore_errors=True)
        figures[mode] = _run_figures(_train_save_run(base, data, runs[mode], mode, steps, save_every, device), mode)
    sync, asyn = figures["sync"], figures["async"]
    result = {
        "preset": f"{preset}[{layers} layers]",
        "device": device,
        "steps": steps,
        "save_every": save_every,
        "stall_s_median": statistics.median(asyn["stall_s"]),
        "stall_s_max": max(asyn["stall_s"]),
        "sync_save_s_median": statistics.median(sync["save_s"]),
        "async_save_s_median": statistics.median(asyn["save_s"]),
        "run_s_nosave": figures["nosave"]["run_s"],
        "run_s_sync": sync["run_s"],
        "run_s_async": asyn["run_s"],
        "tokens_per_s_during_save": asyn["tokens_per_s_during_save"],
        "tokens_per_s_outside_save": asyn["tokens_per_s_outside_save"],
        "blocked_s": {mode: figures[mode]["blocked_s"] for mode in modes if mode != "nosave"},
        "peak_rss_mb": {mode: figures[mode]["peak_rss_mb"] for mode in modes},
        "writer_peak_rss_mb": asyn["writer_peak_rss_mb"],
        "writer_private_mb": asyn["writer_private_mb"],
        "snapshot_mb": asyn["snapshot_mb"],
        "identical": all(_same_checkpoints(runs["sync"], runs[mode]) for mode in _BACKGROUND if mode in runs),
    }
    for mode in [m for m in ("process", "thread") if m in modes]:
        other = figures[mode]
        keys = ("run_s", "tokens_per_s_during_save", "tokens_per_s_outside_save") + (("writer_private_mb",) if mode == "process" else ())
        result[mode] = {k: other[k] for k in keys}  # a thread's "private" memory would be the trainer's
        result[mode].update(stall_s_median=statistics.median(other["stall_s"]), save_s_median=statistics.median(other["save_s"]))
    return result


def _real_model_dir() -> Path:
    return Path(os.environ.get("SLIMTUNE_REAL_MODEL", ".cache/real-model/SmolLM2-135M-Instruct"))


def _default_gguf_tokenizer() -> Path:
    """SmolLM2's tokenizer from the real model's cache (`make real-model`), else the byte-level tokenizer."""
    if (_real_model_dir() / "tokenizer.json").is_file():
        return _real_model_dir()
    fallback = Path(tempfile.mkdtemp(prefix="slimtune-bench-tok-"))
    byte_tokenizer().save_pretrained(str(fallback))
    return fallback


GGUF_CHILD = """
import json, sys, time
from pathlib import Path
from slimtune.gguf_export import GGUFOptions, export_gguf
from slimtune.memory import bytes_written_by_process, peak_rss_mb, reset_peak_rss, rss_mb
base, adapter, out, typ = sys.argv[1:5]
before = rss_mb()
reset = reset_peak_rss()
w0, t0 = bytes_written_by_process(), time.perf_counter()
result = export_gguf(Path(out), GGUFOptions(typ, overwrite=True), base=Path(base), adapter=Path(adapter))
print(json.dumps({"export_s": time.perf_counter() - t0, "bytes_written": bytes_written_by_process() - w0,
                  "reported_bytes": result.bytes, "tensors": result.tensors, "rss_before_mb": before,
                  "peak_rss_mb": peak_rss_mb(), "peak_reset": reset}))
"""


def _tokenizer_vocab(tokenizer: Path) -> int:
    """One past the tokenizer's highest token id: the embedding rows the synthetic base needs."""
    from transformers import AutoTokenizer  # heavy, and only the GGUF bench needs it

    return max(AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).get_vocab().values()) + 1


def _gguf_in_child(base: Path, adapter: Path, target: Path, qtype: str) -> dict:
    """slimtune's GGUF export in a fresh child process: its figures (GGUF_CHILD); the file stays."""
    child = subprocess.run(
        [sys.executable, "-c", GGUF_CHILD, str(base), str(adapter), str(target), qtype], stdout=subprocess.PIPE, text=True
    )
    if child.returncode:
        raise SystemExit(f"GGUF export failed with exit code {child.returncode}")
    return json.loads(child.stdout.strip().splitlines()[-1])


LLAMA_CPP_PEER = Path(__file__).resolve().parent.parent / "bench" / "peers" / "llama_cpp_convert.sh"
LLAMA_CPP_TYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes


def _check_llama_cpp_peer(peer: str, qtype: str) -> None:
    """Before anything is written: the peer, its type and its script exist."""
    if peer != "llama.cpp":
        raise SystemExit(f"--peer {peer}: the one GGUF peer is llama.cpp")
    if qtype not in LLAMA_CPP_TYPES:
        raise SystemExit(f"--peer llama.cpp --type {qtype}: convert_hf_to_gguf.py writes {', '.join(LLAMA_CPP_TYPES)}")
    if not LLAMA_CPP_PEER.is_file():
        raise SystemExit(f"--peer llama.cpp: {LLAMA_CPP_PEER} is missing (it lives in the slimtune repository, not the package)")


def _llama_cpp_peer(base: Path, adapter: Path, out: Path, tag: str, qtype: str) -> dict:
    """The merge-then-convert path: ``slimtune merge`` of the same base + adapter (timed: the peer needs
    it), then llama.cpp's convert_hf_to_gguf.py on the merged checkpoint (bench/peers/llama_cpp_convert.sh,
    its own venv, lazy mode, /usr/bin/time -v). The merged checkpoint and the peer's file are removed."""
    merged, target = out / f"merged-{tag}", out / f"{tag}-{qtype}-llama.cpp.gguf"
    try:
        merge = _merge_in_child(base, adapter, merged)
        peer = subprocess.run(["bash", str(LLAMA_CPP_PEER), str(merged), str(target), qtype], stdout=subprocess.PIPE, text=True)
        if peer.returncode:
            raise SystemExit(f"{LLAMA_CPP_PEER.name} failed with exit code {peer.returncode}")
        stats = json.loads(peer.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(merged, ignore_errors=True)
        target.unlink(missing_ok=True)
    return {
        "merge_s": round(merge["merge_s"], 2),
        "merge_peak_rss_mb": round(merge["peak_rss_mb"], 1),
        "merged_bytes": merge["output_bytes"],
        "peer": stats["peer"],
        "peer_llama_cpp_commit": stats["llama_cpp_commit"],
        "peer_lazy": stats["lazy"],
        "peer_s": stats["seconds"],
        "peer_peak_rss_mb": stats["peak_rss_mb"],
        "peer_file_bytes": stats["file_bytes"],
        "merge_plus_peer_s": round(merge["merge_s"] + stats["seconds"], 2),
    }


def bench_gguf(
    preset: str, out: Path, qtype: str, layers: int | None = None, tokenizer: Path | None = None, peer: str | None = None
) -> dict:
    """GGUF export of a synthetic base + adapter (made once under ``out``, reused), merged on the fly, in a
    fresh child process that reports its peak RSS over its own baseline (RSS after imports, peak reset
    with clear_refs), the bytes it wrote and the file's size; the disk's sequential write speed is
    measured in the same run. ``tokenizer``: a directory whose tokenizer files the base gets (the GGUF
    needs a vocabulary; SmolLM2's by default). ``peer="llama.cpp"``: then the merge + llama.cpp converter
    path on the same base + adapter (``_llama_cpp_peer``), its figures added.

    Example: ``bench_gguf("tiny", Path("bench-out"), "q8_0", peer="llama.cpp")``"""
    if peer is not None:
        _check_llama_cpp_peer(peer, qtype)
        if tokenizer is None and not (_real_model_dir() / "tokenizer.json").is_file():  # before anything is written
            raise SystemExit(
                f"--peer llama.cpp: {_real_model_dir()} has no tokenizer.json (run `make real-model` or pass --tokenizer): "
                "convert_hf_to_gguf.py cannot identify the byte-level fallback tokenizer's pre-tokenizer"
            )
    tokenizer = tokenizer or _default_gguf_tokenizer()
    tag, base, adapter = _synthetic_base_and_adapter(preset, out, layers, _tokenizer_vocab(tokenizer))
    target = out / f"{tag}-{qtype}.gguf"
    if peer is not None and not json.loads((base / "config.json").read_text()).get("architectures"):  # the converter needs it
        raise SystemExit(f"{base}/config.json names no architectures (a synthetic base from before they were written): remove {base}")
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    copied = [Path(shutil.copy(f, base / f.name)) for f in tokenizer.glob("*token*") if not (base / f.name).exists()]
    try:  # the base is reused only while its manifest lists every file: the tokenizer goes back out
        stats = _gguf_in_child(base, adapter, target, qtype)
        size = target.stat().st_size
        target.unlink()
        peer_stats = _llama_cpp_peer(base, adapter, out, tag, qtype) if peer else {}  # the merge copies the tokenizer
    finally:
        for f in copied:
            f.unlink()
    for extra in out.glob("Modelfile"):
        extra.unlink()
    write_mb_s = size / stats["export_s"] / 1e6
    return {
        "preset": preset + (f"[{layers} layers]" if layers else ""),
        "type": qtype,
        "base_bytes": base_bytes,
        "file_bytes": size,
        "bytes_written": stats["bytes_written"],
        "written_vs_file": round(stats["bytes_written"] / size, 5),
        "tensors": stats["tensors"],
        "export_s": round(stats["export_s"], 2),
        "write_mb_s": round(write_mb_s, 1),
        "disk_mb_s": round(disk, 1),
        "ratio": round(write_mb_s / disk, 3),
        "rss_before_mb": round(stats["rss_before_mb"], 1),
        "peak_rss_mb": round(stats["peak_rss_mb"], 1),
        "overhead_mb": round(stats["peak_rss_mb"] - stats["rss_before_mb"], 1),
        "peak_reset": stats["peak_reset"],
    } | peer_stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slimtune.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="merged save of a synthetic QLoRA model")
    save.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    save.add_argument("--out", type=Path, required=True)
    save.add_argument("--layers", type=int, default=None, help="override the number of layers")
    save.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    save.add_argument("--device", default="cpu", help="where the model lives during the save (cpu or cuda)")
    merge = sub.add_parser("merge", help="offline merge of a synthetic base + adapter written to --out (once)")
    merge.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    merge.add_argument("--out", type=Path, required=True)
    merge.add_argument("--layers", type=int, default=None, help="override the number of layers")
    merge.add_argument("--device", default="cpu", help="where the merge math runs (cpu or cuda)")
    dsave = sub.add_parser("dist-save", help="cooperative export by N ranks (gloo, FSDP2-sharded synthetic model) vs one process")
    dsave.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    dsave.add_argument("--out", type=Path, default=Path("bench-out"))
    dsave.add_argument("--nproc", type=int, default=2)
    dsave.add_argument("--layers", type=int, default=None, help="override the number of layers")
    load = sub.add_parser("load-moe", help="QLoRA load of a synthetic 2-layer Mixtral of real widths: peak RSS vs resident")
    load.add_argument("--out", type=Path, required=True)
    load.add_argument("--layers", type=int, default=2)
    nf4 = sub.add_parser("nf4", help="NF4 dequantization throughput vs torchao on a 4096x14336 weight")
    nf4.add_argument("--device", default="cpu")
    step = sub.add_parser("train-step", help="the recipe's training step vs a PEFT bf16 LoRA loop, alternated in one run")
    step.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    step.add_argument("--layers", type=int, default=2)
    step.add_argument("--model", type=Path, default=None, help="a real HF checkpoint directory instead of the synthetic preset")
    step.add_argument("--peer", choices=["peft"], default="peft")
    step.add_argument("--out", type=Path, default=Path("bench-out"))
    step.add_argument("--steps", type=int, default=None, help="steps per run (default 6 synthetic, 8 with --model)")
    step.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 synthetic, 4 with --model)")
    step.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512 synthetic, 256 with --model)")
    step.add_argument("--rank", type=int, default=None, help="LoRA rank on all linears (default 8 synthetic, 16 with --model)")
    step.add_argument("--rounds", type=int, default=2, help="slimtune/peer alternations")
    step.add_argument("--compile", action="store_true", help="slimtune with training.compile=true")
    step.add_argument("--threads", type=int, default=None, help="torch CPU threads for both sides (default: as the recipe picks)")
    ts = sub.add_parser("train-save", help="training with no / synchronous / background merged saves (and a writer thread)")
    ts.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    ts.add_argument("--out", type=Path, default=Path("bench-out/train-save"))
    ts.add_argument("--steps", type=int, default=12)
    ts.add_argument("--save-every", type=int, default=4)
    ts.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic model")
    ts.add_argument("--device", default="cpu")
    ts.add_argument("--keep", action="store_true", help="keep the run directories")
    gg = sub.add_parser("gguf", help="GGUF export of a synthetic base + adapter (merged on the fly): peak RSS, bytes, time vs disk")
    gg.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    gg.add_argument("--type", default="q8_0", help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 (default q8_0)")
    gg.add_argument("--out", type=Path, default=Path("bench-out"))
    gg.add_argument("--layers", type=int, default=None, help="override the number of layers")
    gg.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files for the base (default: SmolLM2's)")
    gg.add_argument("--peer", choices=["llama.cpp"], help="also slimtune merge + llama.cpp's convert_hf_to_gguf.py on it")
    args = parser.parse_args(argv)
    quiet_library_logs()
    if args.command == "train-step":
        _train_step(args)
    if args.command == "train-save":
        result = bench_train_save(args.preset, args.out, args.steps, args.save_every, args.layers, args.device)
        if not args.keep:
            for mode in TRAIN_SAVE_MODES:
                shutil.rmtree(args.out / f"run-{mode}", ignore_errors=True)
        print(json.dumps(result))
    if args.command == "gguf":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_gguf(args.preset, args.out, args.type, args.layers, args.tokenizer, args.peer)))
    if args.command == "dist-save":
        print(json.dumps(bench_dist_save(args.preset, args.out, args.nproc, args.layers)))
    if args.command == "load-moe":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_load_moe(args.out, args.layers)))
    if args.command == "nf4":
        print(json.dumps(bench_nf4(device=args.device)))
    if args.command == "merge":
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bench_merge(args.preset, args.out, args.layers, args.device)))
    if args.command == "save":
        result = bench_save(args.preset, args.out, args.layers, args.device)
        if not args.keep:
            shutil.rmtree(args.out / f"save-{args.preset}", ignore_errors=True)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
