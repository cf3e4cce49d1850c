"""checkpoint/writer.py: the files of a save are hashed several at once, each a plain sha256 of its bytes, from the
chunks handed to the writer (nothing read back), a file written whole going past the page cache."""

import hashlib
import threading

import pytest
import torch

import slimtune.checkpoint.writer as writer
import slimtune.formats.manifest as manifest
from slimtune.checkpoint.plan import plan_files
from slimtune.distributed import SINGLE
from slimtune.memory import bytes_read_by_process
from slimtune.tensors import StreamTensor


def _tensor(name: str, seed: int, rows: int = 64, cols: int = 1024) -> StreamTensor:
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return StreamTensor(name, (rows, cols), torch.bfloat16, lambda a, b: full[a:b].contiguous())


class _Overlap:
    """A sha256 stand-in for the writer: each hasher's first update waits (up to 20 s) until a hasher of
    another file has begun one, so only hashes that run at the same time finish without that wait."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started: list[int] = []  # ids of hashers that have begun an update
        self.other = threading.Event()
        self.waited_out = False
        self.count = 0

    def sha256(self, data: bytes = b""):
        outer = self
        with self.lock:
            self.count += 1
            ident = self.count

        class Recorder:
            def __init__(self):
                self.h = hashlib.sha256(data)

            def update(self, chunk):
                with outer.lock:
                    first = not outer.started
                    if ident not in outer.started:
                        outer.started.append(ident)
                    if len(outer.started) > 1:
                        outer.other.set()
                if first and not outer.other.wait(20):
                    outer.waited_out = True
                self.h.update(chunk)

            def hexdigest(self):
                return self.h.hexdigest()

        return Recorder()


def test_shards_are_hashed_at_once_each_a_plain_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "usable_cores", lambda: 4)
    overlap = _Overlap()
    monkeypatch.setattr(manifest, "hashlib", overlap)
    # one chunk per file: a held-up hash (the header's update waits) leaves its writer free to go on
    files = [(f"model-{i:05d}.safetensors", [_tensor(f"w{i}", 10 * i)]) for i in range(3)]
    plan = plan_files(files)
    writer.create_files(tmp_path, plan)
    records = writer.write_planned(tmp_path, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=256 * 1024))
    assert not overlap.waited_out and overlap.other.is_set()  # a second file's hash ran while the first's did
    assert len(overlap.started) == 3
    for record in records:
        data = (tmp_path / record.path).read_bytes()
        assert record.size == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()


def test_one_lane_hashes_the_files_one_after_another(tmp_path, monkeypatch):
    """The bound: with one usable core, a file's hash finishes before the next file's begins."""
    monkeypatch.setattr(manifest, "usable_cores", lambda: 1)
    overlap = _Overlap()
    overlap.other.set()  # no waiting: only the order of the updates is recorded
    order = []
    real = overlap.sha256

    def recording(data=b""):
        rec = real(data)
        ident, update = overlap.count, rec.update
        rec.update = lambda chunk: (order.append(ident), update(chunk))
        return rec

    monkeypatch.setattr(manifest, "hashlib", type("H", (), {"sha256": staticmethod(recording)}))
    plan = plan_files([(f"f{i}.safetensors", [_tensor(f"w{i}", i, rows=256)]) for i in range(3)])
    writer.create_files(tmp_path, plan)
    records = writer.write_planned(tmp_path, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=32 * 1024))
    assert order == sorted(order) and len(set(order)) == 3
    for record in records:
        assert record.sha256 == hashlib.sha256((tmp_path / record.path).read_bytes()).hexdigest()


def test_a_file_written_whole_goes_past_the_page_cache_and_is_hashed_from_its_chunks(tmp_path, monkeypatch):
    """One rank writing a file whole: every whole block after the header's goes through O_DIRECT
    (``DirectAppend``), and the sha256 comes from the chunks handed to the writer, with no read of the
    file: the process reads less than a tenth of the file's bytes (the header's block, read back once
    to be rewritten as it is), and maps nothing."""
    import mmap
    import os

    import slimtune.diskio as diskio

    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    direct = []
    real_direct = diskio._pwrite_direct

    def record(fd, view, offset):
        direct.append((offset, len(view)))
        real_direct(fd, view, offset)

    monkeypatch.setattr(diskio, "_pwrite_direct", record)
    plan = plan_files([("model.safetensors", [_tensor(f"w{k}", k, rows=512) for k in range(3)])])  # 3 MB
    writer.create_files(tmp_path, plan)
    maps = []
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: maps.append(a))
    read_before = bytes_read_by_process()
    [record] = writer.write_planned(tmp_path, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=256 * 1024))
    read = bytes_read_by_process() - read_before
    monkeypatch.undo()
    data = (tmp_path / "model.safetensors").read_bytes()
    assert record.size == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()
    if not direct:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: only the fallback ran")
    assert direct[0][0] == 0 and sum(n for _, n in direct) == len(data) // 4096 * 4096  # all but the last partial block
    assert maps == [] and read < len(data) / 10, read


def test_file_lanes_write_two_files_at_once_with_the_same_bytes_and_records(tmp_path, monkeypatch):
    """``file_lanes=2`` (a model in memory: any file's rows from any thread): two files are in the writer
    at the same time, and every file and record equals the one-lane writer's."""
    monkeypatch.setattr(manifest, "usable_cores", lambda: 2)
    files = [(f"model-{i:05d}.safetensors", [_tensor(f"w{i}.{k}", 10 * i + k, rows=256) for k in range(2)]) for i in range(4)]
    plan = plan_files(files)
    inside, most = set(), [0]
    lock = threading.Lock()
    real_write = writer._RowSink.write

    def write(self, chunk):
        with lock:
            inside.add(self.path.name)
            most[0] = max(most[0], len(inside))
        try:
            real_write(self, chunk)
            threading.Event().wait(0.002)  # long enough for the other lane to be inside too
        finally:
            with lock:
                inside.discard(self.path.name)

    records = {}
    for lanes in (1, 2):
        out = tmp_path / f"lanes{lanes}"
        out.mkdir()
        writer.create_files(out, plan)
        monkeypatch.setattr(writer._RowSink, "write", write)
        records[lanes] = writer.write_planned(out, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=64 * 1024), None, lanes)
        monkeypatch.setattr(writer._RowSink, "write", real_write)
        assert most[0] == lanes, (lanes, most[0])
        most[0] = 0
    assert records[1] == records[2]
    for record in records[2]:
        data = (tmp_path / "lanes2" / record.path).read_bytes()
        assert data == (tmp_path / "lanes1" / record.path).read_bytes() and record.sha256 == hashlib.sha256(data).hexdigest()


def test_a_failing_file_lane_stops_the_other_and_its_error_is_raised(tmp_path, monkeypatch):
    """One lane's failure stops the other lane at its next chunk; the failure itself is raised."""
    monkeypatch.setattr(manifest, "usable_cores", lambda: 2)
    plan = plan_files([(f"f{i}.safetensors", [_tensor(f"w{i}", i, rows=2048)]) for i in range(2)])  # 4 MB each
    writer.create_files(tmp_path, plan)
    written: dict[str, int] = {}
    real_write = writer._RowSink.write

    def write(self, chunk):
        written[self.path.name] = written.get(self.path.name, 0) + 1
        if self.path.name == "f0.safetensors" and written[self.path.name] == 3:
            raise OSError(28, "No space left on device (injected)")
        if self.path.name == "f1.safetensors":
            threading.Event().wait(0.01)  # the other lane is slow: without the stop it would write on for ~1 s
        real_write(self, chunk)

    monkeypatch.setattr(writer._RowSink, "write", write)
    with pytest.raises(OSError, match="injected"):
        options = writer.WriteOptions(progress=False, chunk_bytes=64 * 1024, inflight_bytes=64 * 1024)  # a chunk or two queued
        writer.write_planned(tmp_path, plan, SINGLE, options, None, 2)
    assert written["f0.safetensors"] == 3 and written.get("f1.safetensors", 0) < 64  # of its 128 chunks: it stopped early
