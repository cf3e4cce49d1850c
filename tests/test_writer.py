"""checkpoint/writer.py: the files of a save are hashed several at once, each a plain sha256 of its bytes."""

import hashlib
import threading

import torch

import slimtune.checkpoint.writer as writer
import slimtune.formats.manifest as manifest
from slimtune.checkpoint.plan import plan_files
from slimtune.distributed import SINGLE
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
    monkeypatch.setattr(writer, "hashlib", overlap)
    files = [(f"model-{i:05d}.safetensors", [_tensor(f"w{i}.{k}", 10 * i + k) for k in range(3)]) for i in range(3)]
    plan = plan_files(files)
    writer.create_files(tmp_path, plan)
    records = writer.write_planned(tmp_path, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=32 * 1024))
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

    monkeypatch.setattr(writer, "hashlib", type("H", (), {"sha256": staticmethod(recording)}))
    plan = plan_files([(f"f{i}.safetensors", [_tensor(f"w{i}", i, rows=256)]) for i in range(3)])
    writer.create_files(tmp_path, plan)
    records = writer.write_planned(tmp_path, plan, SINGLE, writer.WriteOptions(progress=False, chunk_bytes=32 * 1024))
    assert order == sorted(order) and len(set(order)) == 3
    for record in records:
        assert record.sha256 == hashlib.sha256((tmp_path / record.path).read_bytes()).hexdigest()
