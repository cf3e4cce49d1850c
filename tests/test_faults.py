"""Faults end in one clear line, exit status 2 and nothing lost: a full disk (a small tmpfs where root may
mount one, else an injected ENOSPC), a file-size limit (RLIMIT_FSIZE, real EFBIG), a read-only output
(a read-only bind mount as root, else a directory without write permission: EACCES), and SIGKILL at the
awkward moments (mid-shard of a merge and of an overwrite save, while the tiny base is written, between a
checkpoint's rename and its metrics line). The killed children run side by side to keep this file short."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slimtune.checkpoint.atomic import atomic_directory, is_complete_checkpoint, reclaim_leftovers
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import save_checkpoint
from slimtune.checkpoint.writer import WriteOptions
from slimtune.cli import main
from slimtune.errors import SlimtuneError
from slimtune.fileio import atomic_file
from slimtune.lora import LoRAConfig
from slimtune.model import load_qlora_model
from slimtune.tiny import make_tiny_checkpoint
from tests.conftest import ROOT, digest, perturb_adapters

IS_ROOT = os.geteuid() == 0
_Usage = collections.namedtuple("usage", "total used free")
TRAIN = [{"text": f"line {i}: checkpoints survive faults."} for i in range(8)]
RUN_SETTINGS = [
    'model.path="{output_dir}/base"',
    "model.create_tiny=false",
    'dataset.path="{output_dir}/train.jsonl"',
    "dataset.create_builtin=false",
    "training.batch_size=2",
    "training.gradient_accumulation_steps=2",
    "training.total_epochs=2",
    "lora.dropout=0.1",
    "checkpoint.save_every_n_steps=1",
    "checkpoint.keep_last_n=null",
    "checkpoint.merged=never",
    "checkpoint.async=false",  # the faults of the save in the trainer's process (the background writer's: test_recipe.py)
    "logging.progress_bar=false",
]


def hidden(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


def make_run_dir(out: Path, base: Path) -> Path:
    """A run directory holding its own base model and data, so it can be moved as a whole."""
    out.mkdir(parents=True)
    shutil.copytree(base, out / "base")
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    return out


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, command: str) -> str:
    """The error line: the last line of stderr and the only one that is not a progress bar."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("write ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"slimtune {command}: error: ") and err.rstrip().endswith(lines[0]), err
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# Mounts (root) with fallbacks that still raise real or injected OSErrors


def _mount(*args: str) -> bool:
    return IS_ROOT and subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def small_filesystem(path: Path, size: str, monkeypatch):
    """A tmpfs of ``size`` at ``path``; without the right to mount, ENOSPC is injected into ``os.pwrite``
    (how the writer writes tensor bytes) after 256 KiB: the fallback."""
    path.mkdir(parents=True, exist_ok=True)
    if _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)):
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(path)], check=True)
        return
    pwrite, written = os.pwrite, {"n": 0}

    def full(fd, data, offset):
        written["n"] += len(data)
        if written["n"] > 256 * 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    yield "injected"


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` read-only: a read-only bind mount as root (chmod does not stop root), else mode 0555."""
    if _mount("--bind", str(path), str(path)):
        try:
            assert _mount("-o", "remount,bind,ro", str(path)), "remount read-only failed"
            yield "read-only file system"
        finally:
            subprocess.run(["umount", "-l", str(path)], check=True)
        return
    mode = path.stat().st_mode
    path.chmod(0o555)
    try:
        yield "permission denied"
    finally:
        path.chmod(mode)


# ---------------------------------------------------------------------------------------------------
# Killed children, started side by side


CHILD = r"""
import os, re, sys, time
marker, kind, pattern, nth, job = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
def stop_here(what):
    open(marker, "w").write(what)
    time.sleep(600)  # the test kills the process here
seen = [0]
if kind == "rename":  # just after a directory is renamed into place
    real_rename = os.rename
    def rename(src, dst, *a, **k):
        real_rename(src, dst, *a, **k)
        if re.search(pattern, str(dst)):
            stop_here(str(dst))
    os.rename = rename
elif kind == "chunk":  # mid-file: after the nth chunk written (pwrite) into a file whose path matches
    real_pwrite = os.pwrite
    def pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        target = os.readlink(f"/proc/self/fd/{fd}")
        if re.search(pattern, target):
            seen[0] += 1
            if seen[0] == nth:
                stop_here(target)
        return n
    os.pwrite = pwrite
elif kind == "tokenizer":  # the tiny base: weights written, tokenizer files not yet
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast.save_pretrained = lambda self, d, *a, **k: stop_here(str(d))
exec(job)
"""


def spawn(tmp: Path, name: str, kind: str, pattern: str, nth: int, job: str, limit_fsize: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    marker = tmp / f"{name}.inside"

    def limit():
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker), kind, pattern, str(nth), job],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )
    return {"child": child, "marker": marker, "kill": kind != "none"}


def finish(job: dict, deadline: float) -> dict:
    child = job["child"]
    try:
        if job["kill"]:
            while not job["marker"].exists():
                if child.poll() is not None:
                    raise AssertionError(f"exited {child.returncode} before the kill point:\n{child.stdout.read()}{child.stderr.read()}")
                assert time.monotonic() < deadline, "never reached the kill point"
                time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return {"returncode": child.returncode, "stdout": stdout, "stderr": stderr}


@pytest.fixture(scope="module")
def source(tiny_base, tmp_path_factory) -> Path:
    """A complete merged checkpoint (adapter + merged model) of the tiny base."""
    model = load_qlora_model(tiny_base, LoRAConfig(rank=8, alpha=16), seed=0, progress=False)
    perturb_adapters(model)
    return save_checkpoint(model, tmp_path_factory.mktemp("source") / "ckpt", WriteOptions(progress=False)).path


@pytest.fixture(scope="module")
def killed(tiny_base, source, tmp_path_factory) -> dict:
    """Every kill window (and the file-size-limited run) at once; each entry: its directory and result."""
    tmp = tmp_path_factory.mktemp("killed")
    (tmp / "overwrite").mkdir()
    shutil.copytree(source, tmp / "overwrite" / "ckpt")
    run = make_run_dir(tmp / "run", tiny_base)
    efbig = make_run_dir(tmp / "efbig", tiny_base)
    base, merge_out, over, tiny = (
        str(tiny_base),
        str(tmp / "merge" / "a" / "b" / "c"),
        str(tmp / "overwrite" / "ckpt"),
        str(tmp / "tiny" / "base"),
    )
    finetune = ["finetune", "--config", "tiny", *RUN_SETTINGS]
    merge_job = (
        f"from slimtune.cli import main; main(['merge', '--base', {base!r}, '--adapter', {str(source)!r}, '--out', {merge_out!r}, "
        "'--max-shard-size', '200KB'])"
    )
    overwrite_job = (
        "from slimtune.lora import LoRAConfig; from slimtune.model import load_qlora_model; "
        "from slimtune.checkpoint.save import save_checkpoint; from slimtune.checkpoint.writer import WriteOptions; "
        "from tests.conftest import perturb_adapters; "
        f"m = load_qlora_model({base!r}, LoRAConfig(rank=8, alpha=16), seed=0, progress=False); perturb_adapters(m, seed=5); "
        f"save_checkpoint(m, {over!r}, WriteOptions(max_shard_size='200KB', overwrite=True, progress=False))"
    )
    tiny_job = f"from slimtune.tiny import make_tiny_checkpoint; make_tiny_checkpoint({tiny!r})"
    run_args = [*finetune, f"output_dir={run}", "training.stop_after_steps=2"]
    efbig_args = [*finetune, f"output_dir={efbig}"]
    # small shards: each is written by two pwrites (its whole blocks past the page cache, then its tail),
    # so the 5th pwrite into a shard stops the merge and the overwrite inside the third of several
    jobs = {
        "merge": spawn(tmp, "merge", "chunk", r"model-0000", 5, merge_job),
        "overwrite": spawn(tmp, "overwrite", "chunk", r"model-0000", 5, overwrite_job),
        "tiny": spawn(tmp, "tiny", "tokenizer", "", 0, tiny_job),
        "run": spawn(tmp, "run", "rename", r"/step-000002$", 0, f"import sys; from slimtune.cli import main; sys.exit(main({run_args!r}))"),
        # the adapter file (~190 kB) fits under the limit; the recipe state (Adam moments: ~380 kB) does not
        "efbig": spawn(tmp, "efbig", "none", "", 0, f"import sys; from slimtune.cli import main; sys.exit(main({efbig_args!r}))", 300_000),
    }
    deadline = time.monotonic() + 240
    return {name: {**finish(job, deadline), "dir": tmp} for name, job in jobs.items()}


def test_kill_mid_shard_of_a_merge_is_reclaimed_by_the_next_merge(killed, source, tiny_base, capsys):
    result, parent = killed["merge"], killed["merge"]["dir"] / "merge" / "a" / "b"
    assert result["returncode"] == -signal.SIGKILL
    assert not (parent / "c").exists()
    assert [n for n in hidden(parent) if n.startswith(".c.tmp-")]  # the killed writer's temporary and its lock
    code, out, err = cli(capsys, "merge", "--base", str(tiny_base), "--adapter", str(source), "--out", str(parent / "c"))
    assert code == 0, err
    assert hidden(parent) == [] and is_complete_checkpoint(parent / "c")


def test_kill_during_an_overwrite_save_keeps_the_checkpoint(killed, source, qlora_model):
    result, parent = killed["overwrite"], killed["overwrite"]["dir"] / "overwrite"
    assert result["returncode"] == -signal.SIGKILL
    assert digest(parent / "ckpt") == digest(source)  # byte-identical, mid-shard of its replacement
    assert hidden(parent)
    save_checkpoint(qlora_model, parent / "next", WriteOptions(adapter_only=True, progress=False))
    assert hidden(parent) == []  # the next save into the same parent reclaimed the dead temporary
    assert digest(parent / "ckpt") == digest(source)


def test_kill_while_the_tiny_base_is_written_leaves_no_half_base(killed):
    result, parent = killed["tiny"], killed["tiny"]["dir"] / "tiny"
    assert result["returncode"] == -signal.SIGKILL
    assert not (parent / "base").exists()  # never a base/ without tokenizer files
    make_tiny_checkpoint(parent / "base")
    assert (parent / "base" / "tokenizer.json").is_file() and (parent / "base" / "config.json").is_file()
    assert hidden(parent) == []


def test_recipe_state_beyond_the_file_size_limit_is_one_line(killed):
    result, out = killed["efbig"], killed["efbig"]["dir"] / "efbig"
    assert result["returncode"] == 2, result["stderr"]
    line = one_error_line(result["stderr"], "finetune")
    assert f"cannot write {out / 'step-000001'}: file too large" in line, line
    assert not list(out.glob("step-*")) and hidden(out) == []  # temporaries removed
    assert not list(out.glob("*.partial"))


def test_kill_after_rename_moved_run_damaged_checkpoint_and_read_only_resume(killed, tmp_path, capsys):
    """One run through four faults: killed between step 2's rename and its metrics line; the run
    directory moved; its newest checkpoint damaged; then resumed with the directory read-only."""
    result, first = killed["run"], killed["run"]["dir"] / "run"
    assert result["returncode"] == -signal.SIGKILL
    assert is_complete_checkpoint(first / "step-000002")
    assert [m["step"] for m in metrics(first)] == [1]  # the kill took step 2's line

    out = tmp_path / "moved"
    shutil.move(first, out)  # placeholders {output_dir}/base and {output_dir}/train.jsonl now point here
    finetune = ["finetune", "--config", "tiny", f"output_dir={out}", *RUN_SETTINGS, "resume=true"]
    code, stdout, err = cli(capsys, *finetune, "training.stop_after_steps=3")
    assert code == 0, err
    assert "resumed from step-000002: step 2" in stdout
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3] and rows[1]["checkpoint"] == "step-000002"
    assert rows[2]["checkpoint"] == "step-000003" and len({m["loss"] for m in rows}) == 3

    adapter = out / "step-000003" / "adapter" / "adapter_model.safetensors"
    damaged = bytearray(adapter.read_bytes())
    damaged[-8:] = b"\xff" * 8
    adapter.write_bytes(bytes(damaged))
    code, stdout, err = cli(capsys, *finetune, "training.stop_after_steps=4")
    assert code == 0, err
    assert "resume: skipping step-000003: adapter/adapter_model.safetensors does not match its manifest entry" in stdout
    aside = [p for p in out.iterdir() if p.name.startswith("step-000003.damaged-")]
    assert len(aside) == 1 and f"moved aside to {aside[0].name}" in stdout
    assert (aside[0] / "adapter" / "adapter_model.safetensors").read_bytes() == bytes(damaged)  # kept, never deleted
    assert is_complete_checkpoint(out / "step-000003") and is_complete_checkpoint(out / "step-000004")
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]

    before = digest(out)
    with read_only(out) as reason:
        code, _, err = cli(capsys, *finetune)
    line = one_error_line(err, "finetune")
    assert code == 2 and f"cannot write {out / 'metrics.jsonl.partial'}: {reason}" in line, line
    assert digest(out) == before


# ---------------------------------------------------------------------------------------------------
# Full disk, read-only output, leftovers of live and dead writers (in this process)


def test_full_disk_mid_merge_is_one_line_and_leaves_nothing(tiny_base, source, tmp_path, monkeypatch, capsys):
    disk = tmp_path / "disk"
    with small_filesystem(disk, "1m", monkeypatch) as kind:
        shutil.copytree(source / "adapter", disk / "adapter")  # an earlier output on the same disk
        before = digest(disk)
        monkeypatch.setattr("slimtune.checkpoint.save.check_free_space", lambda *a, **k: None)  # as if the disk filled meanwhile
        code, _, err = cli(capsys, "merge", "--base", str(tiny_base), "--adapter", str(source), "--out", str(disk / "a" / "b" / "c"))
        line = one_error_line(err, "merge")
        assert code == 2 and f"cannot write {disk / 'a' / 'b' / 'c'}: no space left on device (needs " in line, (kind, line)
        assert " bytes, " in line and " are free)" in line
        assert sorted(p.name for p in disk.iterdir()) == ["adapter"]  # no a/, a/b/, temporary or lock
        assert digest(disk) == before


def test_no_room_for_the_checkpoint_is_refused_before_writing(qlora_model, tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    with small_filesystem(disk, "1m", monkeypatch) as kind:
        if kind != "tmpfs":  # without the right to mount: a 1 MiB file system, as shutil.disk_usage reports it
            monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(2**20, 0, 2**20))
        with pytest.raises(SlimtuneError, match=r"not enough disk space in .*: the checkpoint needs [0-9,]+ bytes"):
            save_checkpoint(qlora_model, disk / "x" / "ckpt", WriteOptions(progress=False))
        assert list(disk.iterdir()) == []


def test_read_only_output_is_one_line(tiny_base, source, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(source / "adapter", ro / "adapter")
    before = digest(ro)
    with read_only(ro) as reason:
        code, _, err = cli(capsys, "merge", "--base", str(tiny_base), "--adapter", str(source), "--out", str(ro / "new" / "m"))
        assert code == 2 and f"cannot write {ro / 'new' / 'm'}: {reason}" in one_error_line(err, "merge")
        with pytest.raises(SlimtuneError, match=f"cannot write the tiny base model {ro / 'base'}: {reason}"):
            make_tiny_checkpoint(ro / "base")
    assert digest(ro) == before and sorted(p.name for p in ro.iterdir()) == ["adapter"]


def test_leftovers_of_dead_writers_go_and_a_live_writer_keeps_its_own(tmp_path):
    dead = tmp_path / ".old.tmp-0123abcd"  # a killed writer: a lock file nobody holds
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".old.tmp-0123abcd.lock").touch()
    legacy = tmp_path / ".older.tmp-89abcdef"  # from before locks (or not slimtune's): no lock file
    legacy.mkdir()
    mine = tmp_path / ".user.tmp-notmine"  # not slimtune's name pattern
    mine.mkdir()
    with atomic_directory(tmp_path / "new") as tmp:
        (tmp / "f").write_text("x")
        assert reclaim_leftovers(tmp_path) == []  # a second writer in the same parent leaves the live one alone
        assert tmp.is_dir()
    assert (tmp_path / "new" / "f").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".older.tmp-89abcdef", ".user.tmp-notmine", "new"]  # lockless: maybe not ours
    CheckpointManager(tmp_path).remove_leftovers()  # in a run directory those names are slimtune's
    assert sorted(p.name for p in tmp_path.iterdir()) == [".user.tmp-notmine", "new"]


def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing(tmp_path):
    """The embedded base and the built-in data are written, then the model load fails (no such target):
    the run's own directory goes, a directory the user had keeps only what it held, and a base written
    outside it goes too. Once a checkpoint exists, a later failure keeps the run directory."""
    from slimtune.config import load_config
    from slimtune.recipes.finetune import run_finetune

    bad = {"lora.target_modules": ["no_such_proj"], "logging.progress_bar": False}
    fresh = tmp_path / "fresh" / "run"
    with pytest.raises(SlimtuneError, match="no_such_proj"):
        run_finetune(load_config("tiny", values={**bad, "output_dir": str(fresh)}))
    assert not fresh.exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    outside = tmp_path / "elsewhere" / "base"
    with pytest.raises(SlimtuneError, match="no_such_proj"):
        run_finetune(load_config("tiny", values={**bad, "output_dir": str(mine), "model.path": str(outside)}))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and not outside.exists()

    done = tmp_path / "done"
    ok = {"output_dir": str(done), "logging.progress_bar": False, "training.max_steps": 2, "checkpoint.save_every_n_steps": 2}
    run_finetune(load_config("tiny", values=ok))
    kept = sorted(p.name for p in done.iterdir())
    with pytest.raises(SlimtuneError):
        run_finetune(load_config("tiny", values={**ok, **bad, "resume": True, "training.max_steps": 4}))
    assert sorted(p.name for p in done.iterdir()) == kept


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "sub" / "Modelfile"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and not target.exists()
        tmp.write_text("one\n")
    assert target.read_text() == "one\n"
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "one\n" and sorted(p.name for p in target.parent.iterdir()) == ["Modelfile"]
    (tmp_path / "afile").write_text("")  # an OSError (the parent is a file) is one line naming the target
    with pytest.raises(SlimtuneError, match=r"afile/Modelfile") as e, atomic_file(tmp_path / "afile" / "Modelfile") as tmp:
        tmp.write_text("x")
    assert "\n" not in str(e.value)
