"""checkpoint/atomic.py, fileio.py and the manifest writer, on small directories (no model)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from slimtune.checkpoint.atomic import atomic_directory, is_complete_checkpoint, reclaim_leftovers
from slimtune.errors import SlimtuneError
from slimtune.fileio import check_free_space, describe_os_error, os_errors, write_atomic
from slimtune.formats.manifest import MANIFEST_NAME, FileRecord, manifest_problems, read_manifest, sha256_bytes, write_manifest

_usage = namedtuple("usage", "total used free")


def test_a_completed_directory_appears_whole_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "a" / "ckpt"
    with atomic_directory(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".ckpt.tmp-") and not target.exists()
        (tmp / "x.txt").write_text("one")
    assert (target / "x.txt").read_text() == "one"
    with pytest.raises(SlimtuneError, match="already exists"):
        with atomic_directory(target):
            pass
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "x.txt").write_text("two")
    assert (target / "x.txt").read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt"]  # no temporary, old copy or lock left


def test_a_failure_leaves_the_earlier_directory_and_no_new_parents(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "ckpt", overwrite=True) as tmp:
        (tmp / "x.txt").write_text("new")
        raise RuntimeError("boom")
    assert (tmp_path / "ckpt" / "x.txt").read_text() == "old"
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "p" / "q" / "new"):
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # p/ and p/q/ made for it are gone too


def test_leftovers_of_a_dead_writer_go_and_a_live_lock_keeps_its_own(tmp_path, caplog):
    dead, live = tmp_path / ".a.tmp-0000dead", tmp_path / ".b.tmp-00001ive"
    for d in (dead, live):
        d.mkdir()
        (d.with_name(d.name + ".lock")).touch()
    fd = os.open(live.with_name(live.name + ".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        caplog.set_level(logging.DEBUG, logger="slimtune")
        assert reclaim_leftovers(tmp_path) == [dead.name]
        assert live.is_dir() and not dead.exists() and caplog.messages == [f"removing {dead.name}, left by an interrupted save"]
        lockless = tmp_path / ".c.tmp-00000000"
        lockless.mkdir()
        assert reclaim_leftovers(tmp_path) == []  # no lock file: maybe not ours
        assert reclaim_leftovers(tmp_path, lockless=True) == [lockless.name]
    finally:
        os.close(fd)


def test_free_space_is_checked_with_a_margin(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _usage(10**9, 10**9 - 20 * 2**20, 20 * 2**20))
    check_free_space(tmp_path / "not" / "yet", 2**20)  # 1 MiB + the 16 MiB margin fit in 20 MiB
    with pytest.raises(SlimtuneError, match=rf"not enough disk space in {tmp_path}: the checkpoint needs 8,388,608 bytes"):
        check_free_space(tmp_path / "not" / "yet", 8 * 2**20)


def test_os_errors_become_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _usage(100, 90, 10))
    line = describe_os_error(OSError(errno.ENOSPC, "No space left on device"), "write", tmp_path / "x", needed=1000)
    assert line == f"cannot write {tmp_path / 'x'}: no space left on device (needs 1,000 bytes, 10 are free)"
    with pytest.raises(SlimtuneError, match=f"cannot write {tmp_path}: read-only file system"), os_errors("write", tmp_path):
        raise OSError(errno.EROFS, "Read-only file system")


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "m.jsonl"
    write_atomic(path, "one\n")
    write_atomic(path, b"two\n", sync=True)
    assert path.read_text() == "two\n"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "two\n" and sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_the_manifest_is_written_last_and_read_back_checked(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"hello")
    assert not is_complete_checkpoint(tmp_path)
    write_manifest(tmp_path, [FileRecord("a.bin", 5, sha256_bytes(b"hello"))], {"kind": "test"})
    manifest = read_manifest(tmp_path)
    assert manifest["kind"] == "test" and manifest["files"] == [{"path": "a.bin", "size": 5, "sha256": sha256_bytes(b"hello")}]
    assert is_complete_checkpoint(tmp_path) and manifest_problems(tmp_path) == []
    assert not (tmp_path / (MANIFEST_NAME + ".partial")).exists()
    (tmp_path / "a.bin").write_bytes(b"hellO")
    assert manifest_problems(tmp_path) == [f"{tmp_path / 'a.bin'}: sha256 differs from the manifest (changed or corrupted bytes)"]


def test_the_manifest_check_hashes_files_at_once_and_reports_in_order(tmp_path, monkeypatch):
    """formats/manifest.manifest_problems: the files are hashed on several threads at once (each file's
    first hash waits, up to 20 s, for another file's to begin: only concurrent hashing passes without
    that wait), each a plain sha256, the problems in the files' order."""
    import hashlib
    import threading

    import slimtune.formats.manifest as manifest

    monkeypatch.setattr(manifest, "usable_cores", lambda: 4)
    blobs = {f"s{i}.bin": bytes([i]) * (1000 + i) for i in range(4)}
    for name, blob in blobs.items():
        (tmp_path / name).write_bytes(blob)
    write_manifest(tmp_path, [FileRecord(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in blobs.items()])
    (tmp_path / "s3.bin").write_bytes(b"\x00" * 1003)
    (tmp_path / "s1.bin").write_bytes(b"\x00" * 1001)
    begun, lock, waited_out = set(), threading.Lock(), []
    other = threading.Event()
    real = manifest.sha256_file

    def concurrent_only(path, *a, **k):
        with lock:
            begun.add(path)
            if len(begun) > 1:
                other.set()
        if not other.wait(20):
            waited_out.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(manifest, "sha256_file", concurrent_only)
    changed = "sha256 differs from the manifest (changed or corrupted bytes)"
    assert manifest_problems(tmp_path) == [f"{tmp_path / 's1.bin'}: {changed}", f"{tmp_path / 's3.bin'}: {changed}"]
    assert waited_out == [] and len(begun) == 4


def test_a_folded_read_check_hashes_the_reads_in_any_order(tmp_path):
    """formats/manifest.ReadCheck with fold: the bytes a command reads, handed to the file's tap, are
    hashed as they are read; reads in file order read nothing more, any other order (overlaps, re-reads,
    gaps, a tail never read) still gives the file's exact sha256; a changed byte anywhere is one line."""
    import random

    from slimtune.formats.manifest import read_check, sha256_file

    rng = random.Random(0)
    data = rng.randbytes(300_000)
    (tmp_path / "w.bin").write_bytes(data)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "other.bin").write_bytes(b"other")
    records = [FileRecord(p.name, p.stat().st_size, sha256_file(p)) for p in sorted(tmp_path.iterdir())]
    write_manifest(tmp_path, records)

    def read(check, spans):
        tap = check.tap(tmp_path / "w.bin")
        for a, b in spans:
            tap.seen(a, memoryview((tmp_path / "w.bin").read_bytes()[a:b]))
        return tap

    in_order = [(i, min(i + 7000, len(data))) for i in range(0, len(data), 7000)]
    check = read_check(tmp_path, fold=True)
    read(check, in_order)
    assert check.tap(tmp_path / "other") is None  # not listed: nothing to check
    check.done()
    assert check.bytes_reread == 0  # every byte came from the reads themselves
    for _ in range(20):
        spans = [(a, a + rng.randrange(1, 40_000)) for a in (rng.randrange(len(data)) for _ in range(rng.randrange(1, 30)))]
        check = read_check(tmp_path, fold=True)
        read(check, [(a, min(b, len(data))) for a, b in spans])
        check.done()
        assert check.bytes_reread <= len(data)
    flipped = bytearray(data)
    flipped[rng.randrange(len(data))] ^= 0x10
    (tmp_path / "w.bin").write_bytes(bytes(flipped))
    for spans in (in_order, in_order[::-1], in_order[:3]):
        check = read_check(tmp_path, fold=True)
        read(check, spans)
        with pytest.raises(SlimtuneError, match=r"w\.bin: sha256 differs from the manifest .*--no-verify reads it as it is"):
            check.done()
    (tmp_path / "w.bin").write_bytes(data)
    (tmp_path / "other.bin").write_bytes(b"OTHER")  # an untapped file is hashed by done()
    check = read_check(tmp_path, fold=True)
    read(check, in_order)
    with pytest.raises(SlimtuneError, match=r"other\.bin: sha256 differs"):
        check.done()
    (tmp_path / "config.json").write_text("[]")  # a file other libraries parse is hashed before read_check returns
    with pytest.raises(SlimtuneError, match=r"config\.json: sha256 differs .*--no-verify reads it as it is"):
        read_check(tmp_path, fold=True)


def test_a_folded_read_check_holds_each_pooled_buffer_until_it_is_hashed(tmp_path, monkeypatch):
    """The tap hashes on a thread that trails the reader; a read into a pooled buffer stays held by the tap
    until hashed, so a reader that takes the pool's only buffer again gets it only after that (here the
    hashing is slowed down: were the buffer reused first, the check would fail)."""
    import random
    import time

    import torch

    from slimtune.checkpoint.staging import BufferPool
    from slimtune.formats.manifest import FileTap, read_check, sha256_file

    data = random.Random(1).randbytes(70_000)
    (tmp_path / "w.bin").write_bytes(data)
    write_manifest(tmp_path, [FileRecord("w.bin", len(data), sha256_file(tmp_path / "w.bin"))])
    update = FileTap._update
    monkeypatch.setattr(FileTap, "_update", lambda self, offset, view: time.sleep(0.02) or update(self, offset, view))
    pool = BufferPool(7000, 1)
    check = read_check(tmp_path, fold=True)
    tap = check.tap(tmp_path / "w.bin")
    for a in range(0, len(data), 7000):
        buf = pool.take((7000,), torch.uint8)  # waits for the tap to let the last read go
        buf.copy_(torch.frombuffer(bytearray(data[a : a + 7000]), dtype=torch.uint8))
        tap.seen(a, buf)
        del buf
    check.done()
    assert check.bytes_reread == 0
