"""``python -m bench train-save``: training with no / synchronous / background merged saves, each run in its
own process (``slimtune finetune``), from its metrics: time blocked by saves, stalls, save seconds,
throughput during and outside a background save, peak RSS; and whether every mode wrote the same files."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from slimtune.checkpoint.background import MECHANISM_ENV
from slimtune.data import write_jsonl
from slimtune.formats.manifest import read_manifest
from slimtune.synthetic import preset_config, write_synthetic_base
from slimtune.tiny import byte_tokenizer

TRAIN_SAVE_MODES = ("nosave", "sync", "async", "process", "thread")
# async: checkpoint.async as it is (on the CPU a writer forked at each save point); process: the writer
# process that rebuilds the model from the base files (what a GPU run uses); thread: the rebuilding
# writer in the trainer's process (GIL). The last two for the comparison of mechanisms.


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
    env = {k: v for k, v in os.environ.items() if k != MECHANISM_ENV} | ({MECHANISM_ENV: mode} if mode == "process" else {})
    cli = [str(Path(__file__).with_name("thread_writer.py"))] if mode == "thread" else ["-m", "slimtune"]  # thread: the bench's writer
    proc = subprocess.run([sys.executable, *cli, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"train-save {mode}: {proc.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run_figures(rows: list[dict], mode: str) -> dict:
    """The training loop's time (steps plus ``blocked_s``: time blocked by saves, the final wait for the
    last background save included), stalls, save durations, throughput of steps during and outside a
    background save, peak RSS."""
    counted = [r for r in rows if mode != "nosave" or "checkpoint" not in r]
    blocked = [r["checkpoint_stall_s"] for r in counted if "checkpoint_stall_s" in r]
    blocked_s = sum(blocked) + sum(r.get("checkpoint_final_wait_s", 0.0) for r in rows)
    # a background run's last save point writes its save synchronously (save_step): blocked, not a stall
    handed = [r for r in counted if "checkpoint_stall_s" in r and not (mode in _BACKGROUND and "checkpoint_final_wait_s" in r)]
    stalls = [r["checkpoint_stall_s"] for r in handed]
    run_s = sum(r["step_s"] for r in rows) + blocked_s
    written = "checkpoint_saved" if mode in _BACKGROUND else "checkpoint_save_s"  # a background save's figures: where it finished
    saves = [r["checkpoint_save_s"] for r in rows if written in r]
    saves += [a["checkpoint_save_s"] for r in rows for a in r.get("checkpoint_also_saved", [])]
    during = [r["tokens_per_s"] for r in rows if r.get("checkpoint_in_flight")]
    outside = [r["tokens_per_s"] for r in rows if not r.get("checkpoint_in_flight")]
    figures = {"run_s": round(run_s, 2), "blocked_s": round(blocked_s, 2), "peak_rss_mb": round(rows[-1]["peak_rss_mb"], 1)}
    if mode != "nosave":
        figures.update(stall_s=[round(s, 3) for s in stalls], save_s=[round(s, 2) for s in saves])
    if mode in _BACKGROUND:
        figures["last_save_s"] = round(next((r["checkpoint_stall_s"] for r in rows if "checkpoint_final_wait_s" in r), 0.0), 2)
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
        "async_last_save_s": asyn["last_save_s"],
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
