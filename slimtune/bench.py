"""Benchmarks (not tests): `python -m slimtune.bench save --preset NAME --out DIR` prints one JSON line;
so do `merge`, `nf4` and `dist-save` (`--nproc 2`: the cooperative export by 2 gloo ranks of an
FSDP2-sharded model next to the single-process save of the same model; `--peer`: torchtune's way).

The model is synthetic but of the real shape: random NF4 codes and scalers for every projection, random
bf16 for embeddings and norms, LoRA r=8 on q_proj and v_proj. Figures are measured in this process:
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
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import LlamaConfig, MixtralConfig

import slimtune  # noqa: F401  (quiets torchao's import-time warnings)
from slimtune.checkpoint.atomic import atomic_directory, is_complete_checkpoint
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.stream import StreamTensor, adapter_tensor_stream
from slimtune.checkpoint.writer import WriteOptions, write_json, write_safetensors, write_sharded
from slimtune.distributed import current_ranks, shard_model
from slimtune.formats.hf import export_config_dict
from slimtune.formats.manifest import read_manifest
from slimtune.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config_dict
from slimtune.lora import DEFAULT_TARGETS, LoRAConfig, lora_modules, qlora_linears
from slimtune.memory import DEFAULT_SHARD_SIZE, bytes_read_by_process, bytes_written_by_process, peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import build_qlora_skeleton, expected_checkpoint_keys, init_lora, set_tensor
from slimtune.quant import is_nf4
from slimtune.quant.nf4 import BLOCK_SIZE, dequantize_nf4_rows, nf4_from_parts, quantize_nf4, scaler_block_size
from slimtune.tiny import tiny_config

PRESETS = {
    "tiny": dict(),
    "llama3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
}
BENCH_LORA = LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"], quantize_modules=list(DEFAULT_TARGETS))


def preset_config(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    if name == "tiny":
        return tiny_config(**overrides)
    return LlamaConfig(
        **{**PRESETS[name], "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **overrides}
    )


def synthetic_nf4(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random codes and scalers with torchao's layout: no slow quantization of a random bf16 weight."""
    numel = shape[0] * shape[1]
    n_blocks = numel // BLOCK_SIZE
    data = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, generator=gen)
    scalers = torch.randint(-128, 128, (n_blocks,), dtype=torch.int8, generator=gen)
    factor = (torch.rand(n_blocks // scaler_block_size(shape), generator=gen) * 1000 + 1000).to(dtype)
    mean = torch.tensor(0.02, dtype=dtype)
    return nf4_from_parts(shape, dtype, data, scalers, factor, mean)


def synthetic_qlora_model(config: LlamaConfig, lora: LoRAConfig = BENCH_LORA, seed: int = 0) -> torch.nn.Module:
    model = build_qlora_skeleton(config, lora)
    gen = torch.Generator().manual_seed(seed)
    nf4_keys = {f"{n}.weight" for n in qlora_linears(model)}
    for key, (shape, dtype) in expected_checkpoint_keys(model).items():
        if key in nf4_keys:
            value = synthetic_nf4(tuple(shape), dtype, gen)
        elif len(shape) == 1:
            value = torch.ones(shape, dtype=dtype)
        else:
            value = (
                (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(dtype)
                if shape.numel() < 2**26
                else _random_bf16_rows(shape, dtype, gen)
            )
        set_tensor(model, key, value)
    if getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    init_lora(model, seed)
    for m in lora_modules(model).values():  # a trained adapter: B non-zero so the merge does real work
        torch.nn.init.normal_(m.lora_b.weight, std=0.01, generator=gen)
    return model


def _random_bf16_rows(shape: torch.Size, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Fill a large tensor in row blocks so no fp32 copy of it is ever held."""
    out = torch.empty(shape, dtype=dtype)
    step = max(1, 2**24 // shape[1])
    for i in range(0, shape[0], step):
        out[i : i + step] = torch.randn((min(step, shape[0] - i), shape[1]), generator=gen) * 0.02
    return out


def write_synthetic_base(config: LlamaConfig, out_dir: Path, max_shard_size: str = DEFAULT_SHARD_SIZE, seed: int = 0) -> Path:
    """A random bf16 Hugging Face checkpoint of the config's shape, streamed to disk chunk by chunk."""

    skeleton = build_qlora_skeleton(config, LoRAConfig(target_modules=[], quantize_modules=[]))

    def random_rows(index: int, shape: torch.Size, dtype: torch.dtype):
        def rows(start: int, end: int) -> torch.Tensor:
            if len(shape) == 1:
                return torch.ones(end - start, dtype=dtype)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index * 65_537 + start)
            return (torch.randn((end - start, *shape[1:]), generator=gen) * 0.02).to(dtype)

        return rows

    stream = [
        StreamTensor(name, tuple(shape), dtype, random_rows(i, shape, dtype))
        for i, (name, (shape, dtype)) in enumerate(expected_checkpoint_keys(skeleton).items())
    ]
    with atomic_directory(out_dir, overwrite=True) as tmp:
        write_sharded(tmp, stream, WriteOptions(max_shard_size=max_shard_size))
        write_json(tmp / "config.json", export_config_dict(config, stream))
    return out_dir


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
    before = rss_mb()
    reset_peak_rss()
    wchar0 = bytes_written_by_process()
    result = save_checkpoint(model, target, WriteOptions(progress=True))
    written = bytes_written_by_process() - wchar0
    peak = peak_rss_mb()
    vram = {"vram_overhead_mb": round((torch.cuda.max_memory_allocated() - vram_before) / 2**20, 1)} if cuda else {}
    output_bytes = result.total_bytes + (target / "slimtune_manifest.json").stat().st_size
    write_mb_s = output_bytes / result.seconds / 1e6
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


def write_synthetic_adapter(config: LlamaConfig, out_dir: Path, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT-format LoRA adapter (r=8 on q_proj and v_proj, random A and B) for a base of this shape."""

    lora = LoRAConfig(rank=rank, alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    model = build_qlora_skeleton(config, lora)
    init_lora(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_b.weight, std=0.01, generator=gen)
    with atomic_directory(out_dir, overwrite=True) as tmp:
        write_json(tmp / ADAPTER_CONFIG, adapter_config_dict(model, "synthetic"))
        write_safetensors(tmp / ADAPTER_WEIGHTS, adapter_tensor_stream(model))
    return out_dir


MERGE_CHILD = """
import json, sys, time
from slimtune.checkpoint.writer import WriteOptions
from slimtune.memory import bytes_read_by_process, bytes_written_by_process, peak_rss_mb
from slimtune.merge import merge_from_files
base, adapter, out, device = sys.argv[1:5]
r0, w0, t0 = bytes_read_by_process(), bytes_written_by_process(), time.perf_counter()
result = merge_from_files(base, adapter, out, WriteOptions(overwrite=True, progress=True, device=device))
print(json.dumps({"merge_s": time.perf_counter() - t0, "bytes_read": bytes_read_by_process() - r0,
                  "bytes_written": bytes_written_by_process() - w0, "output_bytes": result.total_bytes,
                  "peak_rss_mb": peak_rss_mb()}))
"""


def bench_merge(preset: str, out: Path, layers: int | None = None, device: str = "cpu") -> dict:
    """Synthetic base + adapter on disk (made once, reused), then the merge in a fresh child process,
    which reports its own peak RSS (VmHWM of its whole life: interpreter, imports, merge), the figure
    /usr/bin/time -v reports. (The parent's ru_maxrss for children is not used: the kernel folds the
    parent's own high-water mark into it when the child is started with vfork.)"""

    overrides = {"num_hidden_layers": layers} if layers else {}
    config = preset_config(preset, **overrides)
    tag = preset + (f"-{layers}l" if layers else "")
    base, adapter, merged = out / f"base-{tag}", out / f"adapter-{tag}", out / f"merged-{tag}"
    if not is_complete_checkpoint(base):
        write_synthetic_base(config, base)
    if not is_complete_checkpoint(adapter):
        write_synthetic_adapter(config, adapter)
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    disk = disk_write_mb_s(out, min(base_bytes, 2 * 1024**3))
    child = subprocess.run(
        [sys.executable, "-c", MERGE_CHILD, str(base), str(adapter), str(merged), device], stdout=subprocess.PIPE, text=True
    )
    if child.returncode:
        raise SystemExit(f"merge failed with exit code {child.returncode}")
    stats = json.loads(child.stdout.strip().splitlines()[-1])
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
    }


def _free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_rank(rank: int, nproc: int, port: int, model: torch.nn.Module, target: Path, peer: bool, max_shard_size: str, results) -> None:
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
        if peer:
            row["peer"] = _peer_gather_and_merge(model, ranks)
        results.put(row)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the bench
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _peer_gather_and_merge(model: torch.nn.Module, ranks) -> dict:
    """What torchtune's distributed LoRA recipe does at save time, on the same sharded model: the full
    state dict gathered to rank 0's CPU (torch's ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``), NF4 weights upcast to bf16, then ``get_merged_lora_ckpt``'s merge
    (W += alpha / r * B @ A, LoRA keys dropped). Rank 0's peak RSS over it (nothing written)."""

    before = rss_mb()
    reset_peak_rss()
    t0 = time.perf_counter()
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ranks.is_coordinator:
        for key in list(sd):
            if is_nf4(sd[key]):
                sd[key] = sd[key].to(torch.bfloat16)
        for name, module in lora_modules(model).items():
            a, b = sd.pop(f"{name}.lora_a.weight"), sd.pop(f"{name}.lora_b.weight")
            sd[f"{name}.weight"] += module.scaling * b @ a
    merged_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    seconds = time.perf_counter() - t0
    del sd
    peak = peak_rss_mb()
    return {
        "rss_before_mb": round(before, 1),
        "peak_rss_mb": round(peak, 1),
        "overhead_mb": round(peak - before, 1),
        "state_dict_bytes": merged_bytes,
        "seconds": round(seconds, 3),
    }


def dist_export(
    model: torch.nn.Module, target: Path, nproc: int = 2, max_shard_size: str = DEFAULT_SHARD_SIZE, peer: bool = False
) -> list[dict]:
    """The cooperative export of ``model`` to ``target`` by ``nproc`` forked ranks (the model shared
    copy-on-write): each joins a gloo group, FSDP2-shards the model (``shard_model``: it copies its rows
    of every weight) and calls ``save_checkpoint`` with its ``Ranks``. Returns one row per rank, in rank
    order, measured in that rank: RSS before the save, peak RSS (VmHWM, reset before the save) and its
    difference, bytes written and read back, seconds (and the peer's figures with ``peer``).
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


def bench_dist_save(preset: str, out: Path, nproc: int = 2, layers: int | None = None, peer: bool = False) -> dict:
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

    before = rss_mb()
    reset_peak_rss()
    w0 = bytes_written_by_process()
    single = save_checkpoint(model, single_dir, WriteOptions(progress=False))
    single_written = bytes_written_by_process() - w0
    single_peak = peak_rss_mb()
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
    if peer:
        result["peer_rank0"] = rows[0]["peer"]
    return result


MIXTRAL_WIDTHS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)

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
    lookup, on one weight (Llama-3-8B's MLP shape by default); bit-identity checked in the same run."""

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
    params = rows * cols
    return {
        "shape": [rows, cols],
        "device": device,
        "threads": torch.get_num_threads(),
        "torchao_mparams_s": round(params / torchao_s / 1e6, 1),
        "slimtune_mparams_s": round(params / ours_s / 1e6, 1),
        "speedup": round(torchao_s / ours_s, 2),
        "bit_identical": identical,
    }


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
    dsave.add_argument("--peer", action="store_true", help="also FSDP2 get_model_state_dict(full) + merge on rank 0 (torchtune's way)")
    load = sub.add_parser("load-moe", help="QLoRA load of a synthetic 2-layer Mixtral of real widths: peak RSS vs resident")
    load.add_argument("--out", type=Path, required=True)
    load.add_argument("--layers", type=int, default=2)
    nf4 = sub.add_parser("nf4", help="NF4 dequantization throughput vs torchao on a 4096x14336 weight")
    nf4.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.command == "dist-save":
        print(json.dumps(bench_dist_save(args.preset, args.out, args.nproc, args.layers, args.peer)))
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
