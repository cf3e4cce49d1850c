"""slimtune.checkpoint.background: a checkpoint written by the writer process from a snapshot is the
synchronous save of the same state, file for file; the writer's failures reach the trainer as one line."""

from __future__ import annotations

import datetime
import errno
import logging
import os
import re
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch
import torch.distributed as dist

from slimtune.checkpoint.background import BackgroundSaver, WriterGroup, WriterKind, WriterSpec, choose_kind, forked, process
from slimtune.checkpoint.background.process import base_fingerprint
from slimtune.checkpoint.background.protocol import Start, Unavailable
from slimtune.checkpoint.background.reaper import GRACE_S
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import SaveOptions
from slimtune.checkpoint.writer import WriteOptions
from slimtune.distributed import SINGLE
from slimtune.errors import SlimtuneError
from slimtune.lora import LoRAConfig
from slimtune.model import load_qlora_model
from tests.conftest import assert_same_checkpoint, perturb_adapters
from tests.writer_lifetime import busy_processes, orphan_seconds

LORA = LoRAConfig(rank=8, alpha=16)


@pytest.fixture
def snapshot(tiny_base):
    model = load_qlora_model(tiny_base, LORA, seed=0, progress=False)
    perturb_adapters(model, seed=3)
    train_state = {
        "adapter": {n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
        "position": {"epoch": 0, "step_in_epoch": 1},
        "rng": {"0": {"torch": torch.get_rng_state()}},
    }
    return model, {"format": "test", "global_step": 1}, train_state


def said_by_writers(caplog) -> list[str]:
    """What the background package logged (torch's own INFO records, DCP's, left out)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("slimtune.checkpoint.background")]


@pytest.mark.parametrize("mechanism", ["fork", "process"])
def test_background_checkpoint_equals_the_synchronous_save(tiny_base, snapshot, tmp_path, mechanism, monkeypatch):
    """The writer forked with the trainer's model (its memory, copy-on-write, is the snapshot), and the
    process that rebuilds the model from the base files: both write the synchronous save's files. The
    trainer here has used its OpenMP pool and the machine looks like 16 cores: a forked writer that
    computed on several threads would hang (GNU OpenMP after fork), so a watchdog kills it after 120 s."""
    model, state, train_state = snapshot
    monkeypatch.setattr(process, "usable_cores", lambda: 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.randn(512, 512) @ torch.randn(512, 512)  # the trainer's pool is up before the fork
    card = tmp_path / "card.md"
    card.write_text("# card\n")
    options = SaveOptions(WriteOptions("300KB"), extra_files={"README.md": card, "adapter/README.md": card})
    CheckpointManager(tmp_path / "sync").save(model, 1, state, options, train_state)

    shared = model if mechanism == "fork" else None  # the process writer knows nothing of the trainer's model
    saver = BackgroundSaver(WriterSpec(tiny_base, LORA, seed=5), CheckpointManager(tmp_path / "async"), model=shared)
    assert saver.kind == WriterKind(mechanism) and saver.available(1)
    stall = saver.submit(1, state, options, train_state)
    card.write_text("# changed after the save point\n")  # the snapshot holds the bytes of the save point
    with torch.no_grad():  # training goes on: the writer has its own copy (the forked one: its pages as they were)
        for p in train_state["adapter"].values():
            p.add_(1.0)
        for name, p in model.named_parameters():
            if "norm" in name or "embed" in name:
                p.zero_()  # even a frozen tensor changed in the trainer leaves the forked writer's copy alone
    record = {"step": 2, "tokens_per_s": 100.0}
    watchdog = threading.Timer(120, lambda: saver.writer.exit_code() is None and os.kill(saver.writer.pid, signal.SIGKILL))
    watchdog.start()
    try:
        saver.close()
    finally:
        watchdog.cancel()
        torch.set_num_threads(threads)
    saver.annotate(record)
    assert stall >= 0 and record["checkpoint_saved"] == "step-000001" and record["checkpoint_save_s"] > 0
    assert len([p for p in (tmp_path / "sync" / "step-000001").iterdir() if p.name.startswith("model-")]) >= 2
    assert_same_checkpoint(tmp_path / "sync" / "step-000001", tmp_path / "async" / "step-000001")
    assert saver.writer.exit_code() == 0
    assert record["checkpoint_writer_private_mb"] > 0 and record["checkpoint_peak_rss_mb"] > 0


def test_changed_base_files_fall_back_to_the_synchronous_save(tiny_base, snapshot, tmp_path, caplog):
    """The writer that rebuilds the model from the base files falls back (one line); a forked writer,
    which reads no base file (the trainer's model is its snapshot), goes on in the background."""
    base = tmp_path / "base"
    base.mkdir()
    for p in tiny_base.iterdir():
        (base / p.name).write_bytes(p.read_bytes())
    caplog.set_level(logging.INFO, logger="slimtune")
    saver = BackgroundSaver(WriterSpec(base, LORA), CheckpointManager(tmp_path / "run"))
    shared = BackgroundSaver(WriterSpec(base, LORA), CheckpointManager(tmp_path / "forked"), model=snapshot[0])
    assert base_fingerprint(base) == saver.writer.fingerprint
    config = base / "config.json"
    config.write_text(config.read_text() + " ")
    assert not saver.available(3) and not saver.available(4)
    assert said_by_writers(caplog) == [
        f"checkpoint.async: the base files in {base} changed since the run started; saving synchronously from step 3 on"
    ]
    saver.close()
    assert saver.writer.exit_code() is not None
    assert shared.kind == WriterKind.FORK and shared.available(3) and len(said_by_writers(caplog)) == 1
    shared.close()


def test_a_dead_writer_is_one_line(tiny_base, snapshot, tmp_path):
    _, state, train_state = snapshot
    saver = BackgroundSaver(WriterSpec(tiny_base, LORA), CheckpointManager(tmp_path / "run"))
    assert saver.available(1)
    os.kill(saver.writer.pid, signal.SIGKILL)
    with pytest.raises(SlimtuneError, match=r"^the checkpoint writer died \(killed by SIGKILL\) while writing step-000001; "):
        saver.submit(1, state, SaveOptions(WriteOptions(adapter_only=True)), train_state)
        saver.close()


def test_a_killed_forked_writer_is_one_line_and_leaves_no_temporary(tiny_base, snapshot, tmp_path):
    model, state, train_state = snapshot
    manager = CheckpointManager(tmp_path / "run")
    saver = BackgroundSaver(WriterSpec(tiny_base, LORA), manager, model=model)
    saver.submit(1, state, SaveOptions(WriteOptions("300KB")), train_state)
    os.kill(saver.writer.pid, signal.SIGKILL)
    with pytest.raises(SlimtuneError, match=r"^the checkpoint writer died \(killed by SIGKILL\) while writing step-000001; "):
        saver.close()
    assert not list((tmp_path / "run").glob("*"))  # a temporary directory it made reclaimed (its lock was free)


def test_the_mechanism_follows_where_the_model_lives(tiny_base, snapshot, tmp_path):
    model = snapshot[0]
    spec, manager = WriterSpec(tiny_base, LORA), CheckpointManager(tmp_path / "run")
    assert choose_kind("fork", SINGLE, model) == WriterKind.FORK
    assert choose_kind("fork", SINGLE, None) == WriterKind.PROCESS  # no model to share: rebuilt from the base files
    assert choose_kind(WriterKind.PROCESS, SINGLE, model) == WriterKind.PROCESS
    with pytest.raises(SlimtuneError, match=r"^SLIMTUNE_ASYNC_WRITER='thread': expected one of fork, process$"):
        BackgroundSaver(spec, manager, kind="thread", model=model)


def test_a_failed_fork_saves_in_the_trainer(tiny_base, snapshot, tmp_path, monkeypatch, caplog):
    """fork() refused (ENOMEM, as under strict overcommit): that save is written by the trainer itself,
    the same files, one log line, and its figures reach the step's record."""
    model, state, train_state = snapshot
    options = SaveOptions(WriteOptions("300KB"))
    CheckpointManager(tmp_path / "sync").save(model, 1, state, options, train_state)

    def refused():
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(forked.os, "fork", refused)
    caplog.set_level(logging.INFO, logger="slimtune")
    saver = BackgroundSaver(WriterSpec(tiny_base, LORA), CheckpointManager(tmp_path / "async"), model=model)
    stall = saver.submit(1, state, options, train_state)
    record = {"step": 1, "tokens_per_s": 100.0}
    saver.annotate(record)
    saver.close()
    said = said_by_writers(caplog)[0]
    assert said == "checkpoint.async: cannot fork the checkpoint writer (Cannot allocate memory); saving step-000001 in the trainer"
    assert record["checkpoint_saved"] == "step-000001" and stall >= record["checkpoint_save_s"] > 0
    assert_same_checkpoint(tmp_path / "sync" / "step-000001", tmp_path / "async" / "step-000001")


def test_a_writer_whose_peers_never_join_answers_failed_within_the_join_timeout(tmp_path, monkeypatch):
    """Under torchrun a writer joins the writers' group at the coordinator's store; where a peer never
    comes, joining fails after the join timeout (2 s here, 120 s in a run; not the collectives' 1800 s)
    and the writer answers ``Unavailable`` (one line): the trainers then save synchronously (``available``)."""
    monkeypatch.setattr(process, "_JOIN_TIMEOUT", datetime.timedelta(seconds=2))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    ours, theirs = socket.socketpair()
    trainer = Connection(ours.detach())
    trainer.send(Start(WriterSpec(tmp_path / "base", LORA, group=WriterGroup("127.0.0.1", store.port, 1, 2)), tmp_path / "run"))
    started = time.monotonic()
    process.serve(Connection(theirs.detach()))  # rank 1's writer; rank 0's never comes
    took = time.monotonic() - started
    answer = trainer.recv()
    assert isinstance(answer, Unavailable), answer
    assert answer.line.startswith("the checkpoint writers did not all join their group within 2 s ("), answer
    assert "\n" not in answer.line and 2 <= took < 15, took
    assert not dist.is_initialized()


def test_a_writer_outlives_its_killed_trainer_by_seconds_at_most(tiny_base, snapshot, tmp_path, caplog):
    """The trainer SIGKILLed mid background save while two busy processes hold the cores: its forked
    writer (nice 19) is gone within GRACE_S and a margin, at a moment of the save and inside one
    long C call, where its SIGTERM cannot act and the reaper ends it. What that one left is a
    temporary directory whose lock is free: the next run in that directory waits for no one and
    reclaims it. (The worst of 30 kills: tests/writer_lifetime.py.)"""
    spinners = busy_processes(2)
    try:
        # one kill at a moment of the save, one inside the long call (each ~GRACE_S + a fork and a save)
        took = [orphan_seconds(snapshot[0], tiny_base, tmp_path / f"run-{i}", inside_call=i > 0, moment=0.3) for i in range(2)]
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(f"writers gone {', '.join(f'{s:.2f}' for s in took)} s after their trainers")
    assert max(took) < GRACE_S + 4, took
    assert min(took[1:]) >= GRACE_S * 0.9, took  # inside the call: the reaper, not the SIGTERM, ended them
    run = tmp_path / "run-1"
    assert [p.name for p in run.iterdir() if re.match(r"^\.step-000001\.tmp-[0-9a-f]{8}$", p.name)]
    manager = CheckpointManager(run)
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        assert manager.find_resume_point(resume=True, overwrite=False) is None and time.monotonic() - started < 5
    assert "waiting for" not in caplog.text
    manager.prepare(fresh_start=True, overwrite=False)
    assert not list(run.iterdir())
