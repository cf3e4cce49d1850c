"""checkpoint/manager.py on run directories made by hand (no model, no training): the resume point,
pruning, leftovers of interrupted saves, damaged checkpoints set aside; and checkpoint/run_state.py's
rule of what may change on resume."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from slimtune.checkpoint import manager as manager_module
from slimtune.checkpoint.manager import STATE_NAME, CheckpointManager, checkpoint_problem
from slimtune.checkpoint.run_state import STATE_FORMAT, ResumePoint, check_resumable, portable_config
from slimtune.config import load_config
from slimtune.errors import SlimtuneError
from slimtune.formats.manifest import FileRecord, sha256_file, write_manifest


@pytest.fixture
def said(caplog):
    """What the checkpoint modules log at INFO (what the CLI prints): ``said.messages``."""
    caplog.set_level(logging.INFO, logger="slimtune")
    return caplog


NEEDED = (STATE_NAME, "train_state/.metadata", "adapter/adapter_model.safetensors")


def _step(out: Path, step: int, complete: bool = True, fmt: str = STATE_FORMAT) -> Path:
    """A step-N directory with the three files resume checks, and (``complete``) its manifest."""
    path = out / f"step-{step:06d}"
    (path / "train_state").mkdir(parents=True)
    (path / "adapter").mkdir()
    torch.save({"format": fmt, "global_step": step}, path / STATE_NAME)
    (path / "train_state" / ".metadata").write_bytes(b"dcp metadata %d" % step)
    (path / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter %d" % step)
    if complete:
        write_manifest(path, [FileRecord(n, (path / n).stat().st_size, sha256_file(path / n)) for n in NEEDED])
    return path


def test_the_resume_point_is_the_newest_complete_checkpoint(tmp_path, said):
    manager = CheckpointManager(tmp_path)
    assert manager.find_resume_point(resume=True, overwrite=False) is None  # nothing yet: a fresh start
    assert said.messages == [f"resume: no complete checkpoint under {tmp_path}; starting from step 0"]
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    _step(tmp_path, 6, complete=False)
    bad = _step(tmp_path, 5)
    (bad / "adapter" / "adapter_model.safetensors").write_bytes(b"changed")
    _step(tmp_path, 3, fmt="something-else/1")
    point = manager.find_resume_point(resume=True, overwrite=False)
    assert isinstance(point, ResumePoint) and point.path.name == "step-000004" and point.state["global_step"] == 4
    assert said.messages[1:] == [
        "resume: skipping step-000006: incomplete (no slimtune_manifest.json)",
        "resume: skipping step-000005: adapter/adapter_model.safetensors does not match its manifest entry",
    ]
    assert [p.name for _, p in manager.step_dirs()] == [f"step-00000{i}" for i in (6, 5, 4, 3, 2)]
    assert checkpoint_problem(tmp_path / "step-000002") is None


def test_without_resume_existing_checkpoints_need_overwrite(tmp_path):
    _step(tmp_path, 1)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(SlimtuneError, match="already holds checkpoints \\(step-000001\\); pass resume=true"):
        manager.find_resume_point(resume=False, overwrite=False)
    assert manager.find_resume_point(resume=False, overwrite=True) is None
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    manager.prepare(fresh_start=True, overwrite=True)  # the previous run's checkpoints and metrics go
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pruning_keeps_the_newest_n_complete_and_never_the_last_one(tmp_path):
    for step in (1, 2, 3):
        _step(tmp_path, step)
    _step(tmp_path, 4, complete=False)
    assert CheckpointManager(tmp_path, keep_last_n=None).prune() == []
    assert CheckpointManager(tmp_path, keep_last_n=2).prune() == ["step-000001"]
    assert CheckpointManager(tmp_path, keep_last_n=0).prune() == ["step-000002"]  # the newest complete one stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]  # incomplete ones are not counted


def test_leftovers_of_interrupted_saves_and_deletions_go(tmp_path, said):
    _step(tmp_path, 1)
    for name in (".step-000002.deleting-0123abcd", ".step-000009.tmp-0123abcd", ".recipe_state-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    CheckpointManager(tmp_path).prepare(fresh_start=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-000001"]
    assert len(said.messages) == 3 and all(s.endswith("left by an interrupted save") for s in said.messages)


def test_a_damaged_checkpoint_is_moved_aside_never_deleted(tmp_path, said):
    damaged = _step(tmp_path, 7, complete=False)
    aside = CheckpointManager(tmp_path).set_aside(damaged)
    assert re.fullmatch(r"step-000007\.damaged-\d{8}T\d{6}Z", aside.name) and not damaged.exists()
    assert (aside / STATE_NAME).is_file()  # kept as it was
    assert said.messages == [f"step-000007 was damaged (incomplete (no slimtune_manifest.json)); moved aside to {aside.name} "
                    "(kept: delete it yourself once unneeded)"]  # fmt: skip
    again = CheckpointManager(tmp_path).set_aside(_step(tmp_path, 7, complete=False))
    assert again != aside and again.name.startswith(aside.name)  # a second one in the same second gets a suffix


def test_what_may_change_on_resume(tmp_path, said):
    out = str(tmp_path / "run")
    then = load_config("tiny", [f"output_dir={out}", "optimizer.lr=1e-3"])
    state = {"config": portable_config(then.values)}
    assert state["config"]["model.path"] == "{output_dir}/base"  # paths under output_dir are stored relative to it
    check_resumable(load_config("tiny", [f"output_dir={out}", "optimizer.lr=2e-3"]), ResumePoint(Path(out), state))
    assert said.messages == ["resume: optimizer.lr changed from 0.001 to 0.002 (allowed)"]
    with pytest.raises(SlimtuneError, match="lora.rank is 4, the checkpoint has 8 \\(these must not change on resume\\)"):
        check_resumable(load_config("tiny", [f"output_dir={out}", "lora.rank=4"]), ResumePoint(Path(out), state))


def test_a_run_waits_for_a_live_writer_in_its_output_dir(tmp_path, monkeypatch, caplog):
    """A temporary directory whose lock a live process holds (a background writer of a run killed a moment
    ago, still finishing) is waited for before the resume point is chosen; once it is free, ``prepare``
    reclaims it. A lock held past the wait is one line: another run writes there."""
    out = tmp_path / "run"
    tmp = out / ".step-000002.tmp-0123abcd"
    tmp.mkdir(parents=True)
    lock = os.open(out / ".step-000002.tmp-0123abcd.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    threading.Timer(1.0, os.close, args=(lock,)).start()  # the writer ends a second from now
    manager = CheckpointManager(out)
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        assert manager.find_resume_point(resume=True, overwrite=False) is None
    assert time.monotonic() - started >= 0.9
    assert f"waiting for {tmp.name} in {out}: a process still writes it" in caplog.text
    manager.prepare(fresh_start=True, overwrite=False)
    assert not list(out.iterdir())

    tmp.mkdir()
    lock = os.open(out / ".step-000002.tmp-0123abcd.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    monkeypatch.setattr(manager_module, "WRITER_WAIT_S", 1.0)
    try:
        with pytest.raises(SlimtuneError, match=rf"^{re.escape(str(out))}: a live process still writes {tmp.name} after 1 s; "):
            manager.find_resume_point(resume=True, overwrite=False)
    finally:
        os.close(lock)
    assert tmp.is_dir()  # never reclaimed while its lock is held
