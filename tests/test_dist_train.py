"""FSDP2 QLoRA training on 2 ranks (gloo, CPU) through the one recipe: the same curve as one process,
training state through DCP (resume 2 -> 2 bit-exact, 2 -> 1 and 1 -> 2 through resharding), the
cooperative export of a training checkpoint, a rank killed mid-export, and background saves
(checkpoint.async, the default: a writer per rank) equal to synchronous ones, a writer's failure one line.

The runs are shared by the tests of this module (each 2-rank run is ~15-25 s here). Every run trains the
tiny config for 6 steps (4 per epoch, a quarter of the data held out: checkpoints, evaluation and
greedy samples at steps 3, 4 and 6) in bf16, with 1 MB shards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slimtune.checkpoint.atomic import MANIFEST_NAME, is_complete_checkpoint, read_manifest
from slimtune.checkpoint.writer import WriteOptions
from tests.conftest import ROOT, assert_same_checkpoint, gone, run_cli

pytestmark = pytest.mark.multiprocess

# bf16 compute: with 2 ranks each rank pads its half of a micro-batch to its own longest example, so
# the matmuls see other shapes and round differently; measured by bench/dist_curves.py: at most 4.5e-5
# relative over 12 steps (docs/benchmarks.md). The bound leaves a margin of about 20x.
LOSS_RTOL = 1e-3


def train(out: Path, nproc: int, *overrides: str, env: dict | None = None, torchrun: bool = False) -> subprocess.CompletedProcess:
    """``slimtune finetune --nproc N`` (or, with ``torchrun``, under torchrun's launcher with N processes)."""
    cmd, environment = train_command(out, nproc, overrides, env, torchrun)
    return subprocess.run(cmd, capture_output=True, text=True, env=environment, timeout=300)


def train_command(out: Path, nproc: int, overrides: tuple[str, ...], env: dict | None, torchrun: bool = False) -> tuple[list[str], dict]:
    launch = ["--nproc", str(nproc)] if not torchrun else []
    args = ["finetune", "--config", "tiny", *launch, f"output_dir={out}", "logging.progress_bar=false"]
    args += ["training.max_steps=6", "checkpoint.save_every_n_steps=3", "checkpoint.max_shard_size=1MB", "checkpoint.keep_last_n=10"]
    args += ["dataset.eval_fraction=0.25", "training.sample_prompts=[Hello]", "training.sample_max_new_tokens=4"]  # FSDP2: all ranks
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if torchrun else []
    return [sys.executable, *launcher, "-m", "slimtune", *args, *overrides], environment


def trained(out: Path, nproc: int, *overrides: str) -> Path:
    proc = train(out, nproc, *overrides)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def losses(out: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in r}


def files(ckpt: Path) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in read_manifest(ckpt)["files"]}


def assert_close_curves(a: dict[int, float], b: dict[int, float], steps: frozenset[int] = frozenset(range(1, 7))) -> None:
    assert a.keys() == b.keys() == steps
    for step in a:
        assert abs(a[step] - b[step]) <= LOSS_RTOL * abs(a[step]), (step, a[step], b[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The runs save in the background (checkpoint.async, the default); "two-sync" is "two" saved
    synchronously, on the same base and data files (the model card names them)."""
    root = tmp_path_factory.mktemp("dist-train")
    two = trained(root / "two", 2)
    shared = [f"model.path={two / 'base'}", f"dataset.path={two / 'data' / 'tiny.jsonl'}"]
    return {
        "one": trained(root / "one", 1),
        "two": two,
        "two-sync": trained(root / "two-sync", 2, "checkpoint.async=false", *shared),
        "two-stopped": trained(root / "two-stopped", 2, "training.stop_after_steps=3"),
    }


def resumed_copy(src: Path, dst: Path, nproc: int, env: dict | None = None) -> subprocess.CompletedProcess:
    shutil.copytree(src, dst)
    return train(dst, nproc, "resume=true", env=env)


def test_two_ranks_follow_the_one_rank_curve(runs):
    one, two = losses(runs["one"]), losses(runs["two"])
    assert_close_curves(one, two)
    # held-out loss at every checkpoint, each rank evaluating its slice; greedy samples at each checkpoint
    # (texts may differ where two tokens nearly tie: the adapters differ by rounding)
    assert_close_curves(losses(runs["one"], "eval_loss"), losses(runs["two"], "eval_loss"), {3, 4, 6})
    assert losses(runs["one"], "samples").keys() == losses(runs["two"], "samples").keys() == {3, 4, 6}
    assert losses(runs["two-stopped"]) == {s: v for s, v in two.items() if s <= 3}  # same seed, same ranks: the same steps


def test_torchrun_with_one_process_is_the_plain_run_bit_for_bit(runs, tmp_path):
    """A world of one (a process group, FSDP2 over one rank, DCP) follows the same code path as a plain
    process and gives the same losses and the same files."""
    proc = train(tmp_path / "run", 1, env=None, torchrun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 rank (FSDP2)" in proc.stdout
    assert losses(tmp_path / "run") == losses(runs["one"])
    a, b = files(tmp_path / "run" / "step-000006"), files(runs["one"] / "step-000006")
    for name in a:
        if name.startswith(("model-", "adapter/adapter_model", "config.json")):
            assert a[name] == b[name], name


def test_two_rank_checkpoint_is_the_single_process_save_of_its_adapter_and_verifies(runs, tmp_path):
    """The 2-rank run's merged export, file for file, equals one process saving the same adapter weights
    on the same base, and `slimtune merge --merge-base quantized` of its own adapter; verify passes."""
    from slimtune import save_checkpoint
    from slimtune.formats.layout import ADAPTER_DIR
    from slimtune.formats.peft import ADAPTER_WEIGHTS
    from slimtune.lora import LoRAConfig
    from slimtune.model import load_adapter_weights, load_qlora_model

    ckpt, base = runs["two"] / "step-000006", runs["two"] / "base"
    model = load_qlora_model(base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False, dtype=torch.bfloat16)
    load_adapter_weights(model, ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS)
    save_checkpoint(model, tmp_path / "single", WriteOptions(max_shard_size="1MB", progress=False))
    exported, single = files(ckpt), files(tmp_path / "single")
    shards = [p for p in single if p.startswith("model-")]
    assert len(shards) >= 2  # rows of several files written by both ranks
    for name in [*shards, "model.safetensors.index.json", "config.json", f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"]:
        assert exported[name] == single[name], name

    merge = ["merge", "--base", str(base), "--adapter", str(ckpt), "--out", str(tmp_path / "merged"), "--merge-base", "quantized"]
    merged = run_cli(*merge, "--max-shard-size", "1MB")
    assert merged.returncode == 0, merged.stderr
    remerged = files(tmp_path / "merged")
    # the weights, index and config byte for byte (the tokenizer files differ by design: a training
    # checkpoint carries the chat template training used, the merge copies the base's)
    assert [p for p in remerged if p.startswith("model-")] == shards
    for name in [*shards, "model.safetensors.index.json", "config.json"]:
        assert remerged[name] == exported[name], name
    verify = run_cli("verify", str(ckpt), "--base", str(base), "--adapter", str(ckpt), "--merge-base", "quantized")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_resume_two_to_two_is_bit_exact(runs, tmp_path):
    proc = resumed_copy(runs["two-stopped"], tmp_path / "run", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000003" in proc.stdout
    assert losses(tmp_path / "run") == losses(runs["two"])
    assert losses(tmp_path / "run", "eval_loss") == losses(runs["two"], "eval_loss")
    assert losses(tmp_path / "run", "samples") == losses(runs["two"], "samples")
    a, b = files(tmp_path / "run" / "step-000006"), files(runs["two"] / "step-000006")
    for name in a:
        if name.startswith(("model-", "adapter/adapter_model", "train_state/__")):
            assert a[name] == b[name], name


def test_resume_across_world_sizes_continues_through_resharding(runs, tmp_path):
    two_to_one = resumed_copy(runs["two-stopped"], tmp_path / "two-to-one", 1)
    assert two_to_one.returncode == 0, two_to_one.stderr[-3000:]
    assert "written by 2 rank(s), this run has 1" in two_to_one.stdout
    assert_close_curves(losses(tmp_path / "two-to-one"), losses(runs["two"]))

    one_stopped = tmp_path / "one-stopped"
    shutil.copytree(runs["one"], one_stopped)
    for step in ("step-000004", "step-000006"):
        shutil.rmtree(one_stopped / step)
    one_to_two = train(one_stopped, 2, "resume=true")
    assert one_to_two.returncode == 0, one_to_two.stderr[-3000:]
    assert "written by 1 rank(s), this run has 2" in one_to_two.stdout
    assert_close_curves(losses(one_stopped), losses(runs["one"]))


def test_sigkill_of_one_rank_mid_export_keeps_the_earlier_checkpoint_and_resumes(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["two-stopped"], run)
    before = {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()}
    killer = {"PYTHONPATH": f"{ROOT / 'tests' / 'killer'}{os.pathsep}{ROOT}", "SLIMTUNE_KILL_RANK": "1", "SLIMTUNE_KILL_AT": "3"}
    proc = train(run, 2, "resume=true", "checkpoint.async=false", env=killer)  # rank 1 dies in its rows of step-000004's shards
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slimtune finetune: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1 killed by SIGKILL" in proc.stderr and "Traceback" not in proc.stderr
    assert {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()} == before
    assert not any(p.name == MANIFEST_NAME for p in run.rglob("*") if "step-000003" not in p.parts)
    assert [p.name for p in run.iterdir() if p.name.startswith("step-")] == ["step-000003"]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporary directory left

    again = train(run, 2, "resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(run) == losses(runs["two"])
    assert is_complete_checkpoint(run / "step-000006")


# --- checkpoint.async under torchrun: a writer process per rank, the writers' own process group ---


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_run_facts(state: dict) -> dict:
    """A recipe state without what differs between the two runs: step timings, the stall, and the
    config's output_dir, checkpoint.async and the paths (the same files, named from another output_dir)."""
    record = {k: v for k, v in state["metrics"].items() if k not in ("tokens_per_s", "step_s", "checkpoint_stall_s")}
    config = {k: v for k, v in state["config"].items() if k not in ("output_dir", "checkpoint.async", "model.path", "dataset.path")}
    return {**state, "metrics": record, "config": config}


def test_background_saves_under_torchrun_equal_the_synchronous_ones(runs):
    """Each rank's writer process writes its part of the same cooperative save (its rows of the merged
    shards, its DCP shard of the training state) while the ranks train on: every file of every checkpoint
    equals the synchronous run's (DCP's .metadata and recipe_state.pt by content)."""
    two, sync = runs["two"], runs["two-sync"]
    assert losses(two) == losses(sync)
    for step in (3, 4, 6):
        a, b = two / f"step-{step:06d}", sync / f"step-{step:06d}"
        assert_same_checkpoint(a, b, also=frozenset({"recipe_state.pt"}))
        states = [without_run_facts(torch.load(p / "recipe_state.pt", weights_only=True)) for p in (a, b)]
        assert states[0] == states[1]
        assert {"train_state/__0_0.distcp", "train_state/__1_0.distcp"} <= files(a).keys()
        assert sum(p.startswith("model-") for p in files(a)) >= 2  # merged shards, rows written by both writers

    rows = metrics(two)
    saves = {r["step"]: r for r in rows if "checkpoint" in r}
    assert sorted(saves) == [3, 4, 6]
    assert all(saves[s]["checkpoint_stall_s"] >= 0 and saves[s]["checkpoint_snapshot_bytes"] > 0 for s in (3, 4))  # handed over
    # each save is reported once every rank's writer finished it; the last step's save is the trainers' own
    finished = [a for r in rows for a in [*r.get("checkpoint_also_saved", []), r] if "checkpoint_saved" in a]
    assert [a["checkpoint_saved"] for a in finished] == ["step-000003", "step-000004"]
    assert saves[6]["checkpoint_stall_s"] == saves[6]["checkpoint_save_s"] > 0
    for a in finished:
        sizes = sum(f["size"] for f in read_manifest(two / a["checkpoint_saved"])["files"])
        assert a["checkpoint_save_s"] > 0 and a["checkpoint_bytes"] == sizes and a["checkpoint_peak_rss_mb"] > 0
    assert [r["checkpoint_in_flight"] for r in rows[:5]] == [False, False, False, True, True]
    assert all("checkpoint_in_flight" not in r for r in metrics(sync))  # the synchronous run: no writer
    assert all(r["checkpoint_stall_s"] == r["checkpoint_save_s"] for r in metrics(sync) if "checkpoint" in r)


STEP4_ADAPTER = r"/\.step-000004\.tmp-[0-9a-f]+/adapter/adapter_model\.safetensors$"


def test_a_background_writer_failure_under_torchrun_is_one_line(runs, tmp_path):
    """A full disk under the writers (injected at their fsync of step-000004's adapter): every rank stops
    at the same step, rank 0 prints one line, exit status 2; step-000003 is untouched and no temporary
    directory is left."""
    run = tmp_path / "run"
    shutil.copytree(runs["two-stopped"], run)
    before = {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()}
    fault = {
        "PYTHONPATH": f"{ROOT / 'tests' / 'writer_fault'}{os.pathsep}{ROOT}",
        "SLIMTUNE_WRITER_FAULT": f"enospc:0:{STEP4_ADAPTER}",
        "SLIMTUNE_WRITER_MARKER": str(tmp_path / "unused"),
    }
    proc = train(run, 2, "resume=true", env=fault)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slimtune finetune: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot write {run / 'step-000004'}: no space left on device" in errors[0]
    assert "Traceback" not in proc.stderr
    assert {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()} == before
    assert [p.name for p in run.iterdir() if p.name.startswith("step-")] == ["step-000003"]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporary directory left


STEP4_RANK1_STATE = r"/\.step-000004\.tmp-[0-9a-f]+/train_state/__1_0\.distcp$"  # only rank 1's writer writes it


def processes_below(launcher: int) -> dict[int, tuple[int, str]]:
    """The processes below ``launcher``: pid -> (parent pid, name)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            found[int(stat.parent.name)] = (parent, (stat.parent / "comm").read_text().strip())
        except (OSError, IndexError, ValueError):
            continue

    def below(pid: int) -> bool:
        while pid > 1 and pid in found:
            pid = found[pid][0]
            if pid == launcher:
                return True
        return False

    return {pid: found[pid] for pid in found if below(pid)}


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


@pytest.mark.parametrize("stalled", [STEP4_RANK1_STATE, STEP4_ADAPTER], ids=["one-writer-stalled", "both-writers-stalled"])
def test_a_writer_killed_under_torchrun_stops_every_rank_promptly_with_one_line(runs, tmp_path, stalled):
    """A rank's writer SIGKILLed while it writes step-000004 (stalled at an fsync: its own DCP shard, the
    other writer then waits for it in a collective; or the adapter file, which both writers write, both
    stalled): every rank stops with one line naming that writer, exit status 2, well before the writers'
    group timeout; the other writer is stopped too, step-000003 is untouched and no temporary directory
    is left."""
    run, marker = tmp_path / "run", tmp_path / "writer-pid"
    shutil.copytree(runs["two-stopped"], run)
    before = {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()}
    fault = {
        "PYTHONPATH": f"{ROOT / 'tests' / 'writer_fault'}{os.pathsep}{ROOT}",
        "SLIMTUNE_WRITER_FAULT": f"stall:600:{stalled}",
        "SLIMTUNE_WRITER_MARKER": str(marker),
    }
    started = time.monotonic()
    cmd, env = train_command(run, 2, ("resume=true",), fault)
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes = {}
    try:
        while not (marker.exists() and marker.read_text()):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() - started < 150, "no writer reached the fault"
            time.sleep(0.05)
        time.sleep(1)  # the other writer reaches its wait (or its own stall)
        killed, processes = int(marker.read_text()), processes_below(child.pid)
        writers = [pid for pid, (_, name) in processes.items() if name == "slimtune-ckpt"]
        assert killed in writers and len(writers) == 2, processes
        rank = rank_of(processes[killed][0])
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = child.communicate(timeout=150)
        took = time.monotonic() - killed_at
    finally:
        for pid in [child.pid, *processes]:  # nothing of a failed test stays behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"the run ended {took:.1f} s after the writer was killed")
    errors = [line for line in stderr.splitlines() if line.startswith("slimtune finetune: error:")]
    assert child.returncode == 2 and len(errors) == 1, stderr[-3000:]
    expected = f"slimtune finetune: error: the checkpoint writer of rank {rank} died (killed by SIGKILL) while writing step-000004; "
    assert errors[0].startswith(expected), errors[0]
    assert "Traceback" not in stderr
    assert took < 60, took  # not the writers' group timeout (1800 s)
    assert all(gone(pid) for pid in writers), "a writer outlived the run"
    assert {p.relative_to(run): p.read_bytes() for p in (run / "step-000003").rglob("*") if p.is_file()} == before
    assert [p.name for p in run.iterdir() if p.name.startswith("step-")] == ["step-000003"]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporary directory left
    assert max(r["step"] for r in metrics(run)) < 6  # stopped where it learnt of the failure, not at the end
