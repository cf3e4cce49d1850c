"""The fine-tuning recipe as a user runs it (`slimtune finetune` in its own process): exact resume in a new
process, SIGKILL during a save, the errors that must stop a run, and the shipped tiny config."""

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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.checkpoint.manager import checkpoint_problem
from slimtune.cli import main
from slimtune.tiny import DEMO_TEXTS, byte_tokenizer
from tests.conftest import ROOT, assert_same_checkpoint, gone, run_cli

TRAIN_LINES = [
    {"text": "alpha beta gamma delta"},
    {"instruction": "Say hi.", "output": "Hi there."},
    {"messages": [{"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."}]},
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"instruction": "Add.", "input": "2+2", "output": "4"},
    {"text": "Checkpoints are atomic."},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name?"},
            {"role": "assistant", "content": "Tiny."},
        ]
    },
    {"text": "Resume is exact."},
    {"text": "Loss goes down."},
    {"instruction": "Echo x.", "output": "x"},
]
ADAPTER = "adapter/adapter_model.safetensors"


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TRAIN_LINES))
    return path


@pytest.fixture(scope="module")
def settings(tiny_base, train_file) -> list[str]:
    """10 examples, batch 2, accumulation 2: 3 optimizer steps per epoch (the last with one micro-batch),
    2 epochs, a checkpoint every step, dropout on (so the RNG restore matters)."""
    return [
        f"model.path={tiny_base}",
        "model.create_tiny=false",
        f"dataset.path={train_file}",
        "dataset.create_builtin=false",
        "training.batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.total_epochs=2",
        "lora.dropout=0.1",
        "checkpoint.save_every_n_steps=1",
        "checkpoint.keep_last_n=null",
        "logging.progress_bar=false",
    ]


def finetune(out: Path, settings: list[str], *extra: str) -> subprocess.CompletedProcess:
    r = run_cli("finetune", "--config", "tiny", f"output_dir={out}", *settings, *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (for steps whose speed matters more than a fresh interpreter)."""
    code = main(["finetune", "--config", "tiny", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_adapters(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / ADAPTER)), load_file(str(b / ADAPTER))
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, settings) -> Path:
    """All 6 steps in one process: the reference."""
    out = tmp_path_factory.mktemp("straight") / "run"
    finetune(out, settings)
    return out


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, settings) -> Path:
    """Stopped after step 2 (mid-epoch); tests copy it before resuming."""
    out = tmp_path_factory.mktemp("two") / "run"
    r = finetune(out, settings, "training.stop_after_steps=2")
    assert "stopped at step 2" in r.stdout
    return out


def test_resume_is_exact(straight_run, two_step_run, settings, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    mid_epoch = finetune(out, settings, "resume=true", "training.stop_after_steps=3")  # a new process
    assert "resumed from step-000002: step 2, epoch 1, step 3 of the epoch next" in mid_epoch.stdout
    boundary = finetune(out, settings, "resume=true")
    assert "resumed from step-000003: step 3, epoch 2, step 1 of the epoch next" in boundary.stdout

    reference, resumed = metrics(straight_run), metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference]  # bit-identical floats
    assert [m["lr"] for m in resumed] == [m["lr"] for m in reference]
    assert len({m["loss"] for m in reference}) == 6  # the steps really differ
    for step in (3, 6):
        assert_same_adapters(straight_run / f"step-{step:06d}", out / f"step-{step:06d}")
    first, last = load_file(str(straight_run / "step-000001" / ADAPTER)), load_file(str(straight_run / "step-000006" / ADAPTER))
    assert any(not torch.equal(first[k], last[k]) for k in first)  # training moved the adapters


KILL_POINTS = {
    # fsync of a file inside the temporary directory of the step-2 save: the adapter (nothing merged yet),
    # the manifest (written, not yet renamed into place), the directory itself just before the rename
    "adapter-written": (r"/\.step-000002\.tmp-[0-9a-f]+/adapter/adapter_model\.safetensors$", 1),
    "manifest-written": (r"/\.step-000002\.tmp-[0-9a-f]+/slimtune_manifest\.json\.partial$", 1),
    "before-rename": (r"/\.step-000002\.tmp-[0-9a-f]+$", 2),
}
CHILD = """
import os, re, sys, time
pattern, nth, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real_fsync, seen = os.fsync, [0]
def fsync(fd):
    real_fsync(fd)
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if re.search(pattern, target):
        seen[0] += 1
        if seen[0] == nth:
            open(marker, "w").write(target)
            time.sleep(600)  # the test kills the process here, inside the save
os.fsync = fsync
from slimtune.cli import main
sys.exit(main(sys.argv[4:]))
"""


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_during_save_keeps_previous_checkpoint(point, straight_run, settings, tmp_path, capsys):
    pattern, nth = KILL_POINTS[point]
    out, marker = tmp_path / "run", tmp_path / "inside-save"
    args = ["finetune", "--config", "tiny", f"output_dir={out}", *settings, "checkpoint.keep_last_n=1", "checkpoint.async=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, pattern, str(nth), str(marker), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, child.stdout.read().decode()
            assert time.monotonic() < deadline, "the save never reached the kill point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    # The interrupted save is a hidden temporary directory; the previous checkpoint is whole.
    assert [p.name for p in out.glob("step-*")] == ["step-000001"]
    assert is_complete_checkpoint(out / "step-000001") and (out / "step-000001" / "recipe_state.pt").is_file()
    assert list(out.glob(".step-000002.tmp-*"))
    (out / "step-000009").mkdir()  # a newer directory without a manifest: resume must pass it over
    (out / "step-000009" / "junk").write_text("x")

    # Resume (in this process, to keep the test short) and train steps 2 and 3 as the straight run did.
    code, stdout, stderr = run_main(
        capsys, f"output_dir={out}", *settings, "checkpoint.keep_last_n=1", "resume=true", "training.stop_after_steps=3"
    )
    assert code == 0, stdout + stderr
    assert "resume: skipping step-000009: incomplete (no slimtune_manifest.json)" in stdout
    assert "removing .step-000002.tmp-" in stdout
    assert "resumed from step-000001" in stdout
    assert not list(out.glob(".step-*"))
    assert is_complete_checkpoint(out / "step-000003") and not (out / "step-000001").exists()  # keep_last_n=1
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(straight_run)][:3]
    assert_same_adapters(straight_run / "step-000003", out / "step-000003")


@pytest.mark.parametrize(
    "change, needle",
    [
        ("lora.rank=16", "lora.rank is 16, the checkpoint has 8"),
        ("training.batch_size=4", "training.batch_size is 4, the checkpoint has 2"),
        ("training.gradient_accumulation_steps=1", "training.gradient_accumulation_steps is 1"),
        ("seed=1", "seed is 1, the checkpoint has 0"),
        ("dataset.max_seq_len=64", "dataset.max_seq_len is 64"),
        ("lora.target_modules=[q_proj]", "lora.target_modules is ['q_proj']"),
    ],
)
def test_incompatible_resume_fails(change, needle, two_step_run, settings, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    code, _, err = run_main(capsys, f"output_dir={out}", *settings, "resume=true", change)
    assert code == 2
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"slimtune finetune: error: cannot resume from {out / 'step-000002'}:") and needle in message, message
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000001", "step-000002"]


def test_resume_refuses_changed_data_and_allows_schedule_changes(two_step_run, settings, train_file, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    changed = tmp_path / "train.jsonl"
    changed.write_text(train_file.read_text().replace("alpha", "omega"))
    moved = [s if not s.startswith("dataset.path=") else f"dataset.path={changed}" for s in settings]
    code, _, err = run_main(capsys, f"output_dir={out}", *moved, "resume=true")
    assert code == 2 and "dataset.path is" in err  # a different path is a fixed-field change

    code, out_text, err = run_main(
        capsys, f"output_dir={out}", *settings, "resume=true", "training.total_epochs=3", "training.stop_after_steps=2"
    )
    assert code == 0, err
    assert "resume: training.total_epochs changed from 2 to 3 (allowed)" in out_text
    assert "nothing to train" in out_text

    original = train_file.read_text()
    try:
        train_file.write_text(original.replace("alpha", "omega"))
        code, _, err = run_main(capsys, f"output_dir={out}", *settings, "resume=true")
    finally:
        train_file.write_text(original)
    assert code == 2 and "changed since the checkpoint was taken" in err

    code, _, err = run_main(capsys, f"output_dir={out}", *settings)  # neither resume nor overwrite
    assert code == 2 and "already holds checkpoints" in err and "resume=true" in err


def test_config_and_data_errors_exit_2_before_any_work(tmp_path, settings, capsys):
    out = tmp_path / "run"
    r = run_cli("finetune", "--config", "tiny", f"output_dir={out}", "optimizer.lrr=1e-4")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "slimtune finetune: error: override 'optimizer.lrr=1e-4': unknown config key 'optimizer.lrr' (did you mean 'optimizer.lr'?)"
    )
    code, _, err = run_main(capsys, f"output_dir={out}", "training.batch_size=two")
    assert code == 2 and "'training.batch_size' must be an integer, got 'two'" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    code, _, err = run_main(capsys, f"output_dir={out}", f"dataset.path={bad}")  # tiny defaults: the model would be made under out
    assert code == 2 and f"{bad}:3: not valid JSON" in err
    assert not out.exists()


def test_tiny_config_trains_and_its_merged_model_reloads(tmp_path):
    out = tmp_path / "tiny"
    r = run_cli("finetune", "--config", "tiny", f"output_dir={out}", "training.total_epochs=3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "peak RSS of the run:" in r.stdout
    rows = metrics(out)
    assert [m["step"] for m in rows] == list(range(1, 16))
    assert {"step", "epoch", "loss", "lr", "tokens_per_s", "peak_rss_mb"} <= rows[0].keys()
    saves = [m for m in rows if "checkpoint" in m]
    assert [m["step"] for m in saves] == [5, 10, 15]  # epoch ends: 18 built-in examples, batch 4
    assert all(m["checkpoint_stall_s"] >= 0 for m in saves)
    # background saves: figures where each finished (two in one step: the earlier in checkpoint_also_saved);
    # the last step's save written synchronously (no training left to overlap)
    finished = [a for m in rows for a in [*m.get("checkpoint_also_saved", []), m] if "checkpoint_saved" in a]
    assert [m["checkpoint_saved"] for m in finished] == ["step-000005", "step-000010"]
    assert all(m["checkpoint_save_s"] > 0 and m["checkpoint_peak_rss_mb"] > 0 for m in finished)
    assert "checkpoint_saved" not in rows[-1] and rows[-1]["checkpoint_stall_s"] == rows[-1]["checkpoint_save_s"] > 0
    losses = [m["loss"] for m in rows]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000010", "step-000015"]  # keep_last_n: 2
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    tok = byte_tokenizer()
    batch = tok(DEMO_TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(out / "step-000015"), dtype=torch.bfloat16, local_files_only=True)
        base = AutoModelForCausalLM.from_pretrained(str(out / "base"), dtype=torch.bfloat16, local_files_only=True)
        trained_loss = merged(**batch, labels=labels).loss.item()
        base_loss = base(**batch, labels=labels).loss.item()
    assert trained_loss < base_loss - 0.3, (trained_loss, base_loss)


@pytest.mark.parametrize("merged_dtype", [None, "fp32"])
def test_merged_saves_record_eval_loss_merged_and_nf4(tmp_path, merged_dtype):
    """A merged save with eval data also evaluates the merged weights (eval_loss_merged beside eval_loss,
    in metrics.jsonl and the card); checkpoint.merged_dtype sets the merged files' dtype; the load prints
    one NF4 line and the card and slimtune_format.json record the scaler blocks."""
    out = tmp_path / "run"
    extra = [f"checkpoint.merged_dtype={merged_dtype}"] if merged_dtype else []
    r = run_cli(
        "finetune", "--config", "tiny", f"output_dir={out}", "training.max_steps=4", "dataset.eval_fraction=0.25",
        "checkpoint.save_every_n_steps=2", "logging.progress_bar=false", *extra,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NF4: 14 of 14 targets (scaler blocks: 256 x 14)" in r.stdout
    saves = [m for m in metrics(out) if "checkpoint" in m]
    assert [m["step"] for m in saves] == [2, 4]
    for m in saves:
        assert abs(m["eval_loss_merged"] - m["eval_loss"]) < 0.05, m
    if merged_dtype is None:  # bf16: the one rounding of W' + B A shows
        assert any(m["eval_loss_merged"] != m["eval_loss"] for m in saves)
    ckpt = out / "step-000004"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["torch_dtype"] == ("float32" if merged_dtype else "bfloat16")
    assert {t.dtype for t in load_file(str(next(ckpt.glob("model-*.safetensors")))).values()} == {
        torch.float32 if merged_dtype else torch.bfloat16
    }
    card = (ckpt / "README.md").read_text()
    assert f"| eval loss, merged model | {saves[-1]['eval_loss_merged']:.4f}" in card
    assert "NF4 (blocks of 64): 14 of 14 targeted linears" in card
    nf4 = json.loads((ckpt / "slimtune_format.json").read_text())["nf4"]
    assert nf4["scaler_blocks"] == {"256": 14} and nf4["tensors"]["model.layers.0.self_attn.q_proj.weight"] == 256


def test_metrics_past_the_resumed_checkpoint_are_dropped(tmp_path):
    from slimtune.tracking import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')  # cut by a kill
    log = MetricsLog(path, keep_through_step=3)
    log.write({"step": 4, "loss": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    MetricsLog(path, keep_through_step=0)  # a fresh run starts an empty file
    assert path.read_text() == ""


def test_chunked_loss_equals_the_plain_one(monkeypatch):
    import torch.nn.functional as F

    from slimtune import token_loss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, 300, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 300, (3, 70), generator=gen)
    labels[0, :20] = -100
    labels[2, 50:] = -100
    plain = F.cross_entropy(logits[:, :-1].float().reshape(-1, 300), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    n = int((labels[:, 1:] != -100).sum())  # the recipe's token mean: a gradient that is not a power of two
    (plain_grad,) = torch.autograd.grad(plain / n, logits)
    monkeypatch.setattr(token_loss, "CPU_LOSS_CHUNK_BYTES", 4 * 300 * 16)  # chunks of 16 positions
    chunked = token_loss.token_loss_sum(logits, labels)
    (chunked_grad,) = torch.autograd.grad(chunked / n, logits)
    assert torch.allclose(chunked, plain, rtol=1e-6)
    assert torch.equal(chunked_grad, plain_grad)


# --- checkpoint.async: the background writer (slimtune/checkpoint/background/) ---

WRITER_FAULT = ROOT / "tests" / "writer_fault"
STEP2_ADAPTER = r"/\.step-000002\.tmp-[0-9a-f]+/adapter/adapter_model\.safetensors$"


def without_run_facts(state: dict) -> dict:
    """A recipe state without what differs between two runs of one training: the step timings in the
    metrics record, output_dir and checkpoint.async."""
    metrics_record = {k: v for k, v in state["metrics"].items() if k not in ("tokens_per_s", "step_s", "checkpoint_stall_s")}
    config = {k: v for k, v in state["config"].items() if k not in ("output_dir", "checkpoint.async")}
    return {**state, "metrics": metrics_record, "config": config}


def test_async_checkpoints_equal_the_synchronous_ones(straight_run, settings, tmp_path):
    """straight_run saved in the background (the default); the same run saved synchronously writes the
    same files: weights, adapters, optimizer and RNG state, documents (the recipe state differs only in
    step timings and the config's own output_dir and checkpoint.async)."""
    sync = tmp_path / "sync"
    finetune(sync, settings, "checkpoint.async=false")
    rows = metrics(straight_run)
    saved = [a["checkpoint_saved"] for m in rows for a in [*m.get("checkpoint_also_saved", []), m] if "checkpoint_saved" in a]
    assert saved == [f"step-{s:06d}" for s in range(1, 6)]  # the last step's save in the trainer (save_step)
    assert rows[-1]["checkpoint"] == "step-000006" and rows[-1]["checkpoint_stall_s"] == rows[-1]["checkpoint_save_s"]
    assert [m["loss"] for m in metrics(sync)] == [m["loss"] for m in rows]
    for step in range(1, 7):
        a, b = straight_run / f"step-{step:06d}", sync / f"step-{step:06d}"
        assert_same_checkpoint(a, b, also=frozenset({"recipe_state.pt"}))
        states = [without_run_facts(torch.load(p / "recipe_state.pt", weights_only=True)) for p in (a, b)]
        assert states[0] == states[1]
    assert any(p.name.startswith("model-") for p in (sync / "step-000006").iterdir())  # merged shards compared too


def writer_fault(fault: str, marker: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": f"{WRITER_FAULT}{os.pathsep}{ROOT}",
        "SLIMTUNE_WRITER_FAULT": fault,
        "SLIMTUNE_WRITER_MARKER": str(marker),
    }


def finetune_process(out: Path, settings: list[str], env: dict, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "slimtune", "finetune", "--config", "tiny", f"output_dir={out}", *settings, *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stalled_writer(child: subprocess.Popen, marker: Path) -> int:
    """Wait until the writer sleeps inside step-000002's save; its pid."""
    deadline = time.monotonic() + 240
    while not (marker.exists() and marker.read_text()):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the writer never reached the fault"
        time.sleep(0.05)
    return int(marker.read_text())


def only_the_first_checkpoint(out: Path) -> None:
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000001"]
    assert checkpoint_problem(out / "step-000001") is None
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_sigkill_of_the_trainer_mid_background_save(straight_run, settings, tmp_path, capsys):
    """The writer dies with its trainer (removing its temporary directory); the earlier checkpoint is
    whole and resume continues bit-exactly."""
    out, marker = tmp_path / "run", tmp_path / "writer-pid"
    child = finetune_process(out, settings, writer_fault(f"stall:600:{STEP2_ADAPTER}", marker))
    writer = stalled_writer(child, marker)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    assert gone(writer), "the writer outlived its trainer"
    only_the_first_checkpoint(out)

    code, stdout, stderr = run_main(capsys, f"output_dir={out}", *settings, "resume=true", "training.stop_after_steps=3")
    assert code == 0, stdout + stderr
    assert "resumed from step-000001" in stdout
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(straight_run)][:3]
    assert_same_adapters(straight_run / "step-000003", out / "step-000003")


def test_background_failures_stop_the_run_with_one_line(settings, tmp_path):
    """A full disk under the writer, and a writer killed mid-save: the trainer stops at its next step
    with one line and exit 2; step-000001 is whole and no temporary directory is left."""
    lean = [*settings, "checkpoint.merged=never", "training.stop_after_steps=3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    child = finetune_process(full, lean, writer_fault(f"enospc:0:{STEP2_ADAPTER}", tmp_path / "unused"))
    _, stderr = child.communicate(timeout=300)
    errors = [line for line in stderr.splitlines() if line.startswith("slimtune finetune: error:")]
    assert child.returncode == 2 and len(errors) == 1, stderr
    assert f"cannot write {full / 'step-000002'}: no space left on device" in errors[0]
    only_the_first_checkpoint(full)

    child = finetune_process(killed, lean, writer_fault(f"stall:600:{STEP2_ADAPTER}", tmp_path / "writer-pid"))
    os.kill(stalled_writer(child, tmp_path / "writer-pid"), signal.SIGKILL)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 2, stderr
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("slimtune finetune: error: the checkpoint writer died (killed by SIGKILL) while writing step-000002")
    ), stderr
    only_the_first_checkpoint(killed)


HOLD_S = 2.0  # how long the test keeps the writer held once the trainer waits for it


def test_a_save_point_reached_during_a_save_waits_and_counts_as_stall(settings, tmp_path):
    """The writer is held inside step-000001's save until the trainer has reached step 2's save point and
    has waited there HOLD_S: step 2's save point waits for the save in flight, and that wait is stall."""
    out, marker = tmp_path / "run", tmp_path / "m"
    step1 = r"/\.step-000001\.tmp-[0-9a-f]+/adapter/adapter_model\.safetensors$"
    child = finetune_process(
        out, [*settings, "checkpoint.merged=never", "training.stop_after_steps=3"], writer_fault(f"hold:600:{step1}", marker)
    )
    try:
        stalled_writer(child, marker)  # the writer is inside step-000001's save ...
        waiting = marker.with_name(marker.name + ".trainer-waiting")
        deadline = time.monotonic() + 240
        while not waiting.exists():  # ... and the trainer reached step 2's save point and waits for it
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the trainer never waited for the writer"
            time.sleep(0.02)
        seen = time.perf_counter()
        time.sleep(HOLD_S)
        held = time.perf_counter() - seen  # a lower bound of both the save's time and step 2's wait
        marker.with_name(marker.name + ".release").write_text("")
        stdout, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, stdout + stderr
    first, second, third = metrics(out)
    assert first["checkpoint"] == "step-000001" and not first["checkpoint_in_flight"]
    assert second["checkpoint_in_flight"] and second["checkpoint_saved"] == "step-000001"
    assert second["checkpoint_save_s"] > held  # the writer was held inside step-000001's save ...
    assert second["checkpoint_stall_s"] > held  # ... and step 2's save point waited for it: stall
    assert "checkpoint.async: the save before step 2's was still running; the next writers run at nice 10" in stdout
    # the last step waited for step-000002's save, then wrote its own in the trainer, synchronously
    assert third["checkpoint_also_saved"][0]["checkpoint_saved"] == "step-000002" and "checkpoint_saved" not in third
    assert third["checkpoint"] == "step-000003" and third["checkpoint_stall_s"] == third["checkpoint_save_s"] > 0
    assert "checkpoint_final_wait_s" in third and sorted(p.name for p in out.glob("step-*")) == [f"step-00000{i}" for i in (1, 2, 3)]


def test_serving_refusals_warn_in_one_line_at_start_and_the_end_prints_the_serve_commands(tmp_path, capsys):
    """LoRA on lm_head is no refusal (vLLM expects it on Llama-family models): no warning; q_proj without v_proj
    is SGLang's (formats/serving.py). The end of the run prints the commands that serve the adapter, the vLLM
    one with the --max-lora-rank a rank-32 adapter needs."""
    run = ["training.max_steps=1", "checkpoint.merged=never", "checkpoint.async=false", "logging.progress_bar=false"]
    code, out, err = run_main(capsys, f"output_dir={tmp_path / 'run'}", "lora.target_modules=[q_proj,lm_head]", "lora.rank=32", *run)
    assert code == 0, err
    refusal = "SGLang will not load it: q_proj without v_proj (its loader stacks q, k, v and fails on the missing v_proj)"
    assert [line for line in err.splitlines() if "will not load" in line or "loads it" in line] == [
        f"warning: serving this run's adapter: {refusal} (docs/checkpoints.md: serving)",
        f"warning: {refusal}",
    ]
    adapter = tmp_path / "run" / "step-000001" / "adapter"
    vllm = [line for line in out.splitlines() if line.startswith("serve the adapter: vllm serve ")]
    assert len(vllm) == 1 and vllm[0].endswith(f" --enable-lora --max-lora-rank 32 --lora-modules step-000001={adapter}"), out
    assert any(line.startswith("serve the adapter: python -m sglang.launch_server --model-path ") for line in out.splitlines())
