"""``slimtune.diskio``: the pipelined writer thread, writeback as a file is written, appends past the
page cache (O_DIRECT) with their fallback, and the page-cache advice."""

import os
from pathlib import Path

import pytest
import torch

from slimtune import diskio


def test_pipelined_write_propagates_a_producer_error_and_stops(tmp_path):
    def chunks():
        yield torch.zeros(4)
        raise RuntimeError("producer failed")

    class Sink:
        written: list[torch.Tensor] = []

        def write(self, chunk):
            self.written.append(chunk)

    sink = Sink()
    with pytest.raises(RuntimeError, match="producer failed"):
        diskio.pipelined_write(sink, chunks(), inflight_bytes=1)
    assert len(sink.written) == 1  # what came before the error was written, nothing after


def test_the_pipelined_writer_offers_a_trim_every_16_mb_handed_over(monkeypatch):
    """``HeapTrim`` reads /proc/self/status: the writer asks it once ``_TRIM_EVERY_BYTES`` have been handed
    over since it last asked (not after every chunk: a GGUF export's pieces are ~0.5 MB)."""
    calls, written = [], []

    class CountingTrim:
        def __call__(self):
            calls.append(sum(written))
            return False

    class Sink:
        def write(self, chunk):
            written.append(chunk.numel())

    monkeypatch.setattr(diskio, "HeapTrim", CountingTrim)
    monkeypatch.setattr(diskio, "_TRIM_EVERY_BYTES", 40)  # 10 float32 values
    chunks = [torch.zeros(n) for n in (4, 5, 6, 1, 9, 2)]  # 16, 36, 60 (ask), 64, 100 (ask), 108 bytes
    diskio.pipelined_write(Sink(), iter(chunks), inflight_bytes=1 << 20)
    assert len(calls) == 2 and written == [4, 5, 6, 1, 9, 2]


def test_write_back_hands_written_ranges_to_the_kernel_behind_the_end_and_again_to_let_them_go(tmp_path, monkeypatch):
    """``WriteBack`` (the GGUF export's and the hashed save's file): each range it hands to writeback
    (posix_fadvise DONTNEED) is contiguous with the last, ends at least 32 MiB behind the bytes written,
    and everything up to that point is handed on; each such range is advised again once it lies
    ``_DROP_LAG`` behind (its pages written by then, so let go), in order too; the bytes on disk are
    the bytes written."""
    step, lag = 1 << 16, 1 << 18
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length, advice)))
    monkeypatch.setattr(diskio, "_WRITEBACK_BYTES", step)  # 64 KiB steps: a few MB make many ranges
    monkeypatch.setattr(diskio, "_DROP_LAG", lag)
    data = os.urandom(3 << 20)
    path = tmp_path / "f"
    ends = {"started": 0, "dropped": 0}
    with open(path, "wb") as f:
        wb = diskio.WriteBack(f.fileno())
        for i in range(0, len(data), 40_000):
            f.write(data[i : i + 40_000])
            wb.written(f.tell())
            for offset, length, advice in calls:
                assert advice == os.POSIX_FADV_DONTNEED and length >= step
                kind = "started" if offset == ends["started"] else "dropped"
                assert offset == ends[kind], (offset, ends)  # contiguous with its own kind's last range
                ends[kind] = offset + length
            calls.clear()
            assert ends["started"] == wb.released <= max(0, f.tell() - step)
            assert ends["dropped"] == wb.dropped <= max(0, wb.released - lag)
    assert path.read_bytes() == data
    assert wb.released >= len(data) - 3 * step and wb.dropped >= wb.released - lag - 2 * step > 0


def _direct_writes(monkeypatch, fail_at: int | None = None) -> list[tuple[int, int, int]]:
    """Record every O_DIRECT write (offset, length, buffer address); the ``fail_at``-th raises EINVAL."""
    import ctypes
    import errno

    calls, real = [], diskio._pwrite_direct

    def record(fd, view, offset):
        if fail_at is not None and len(calls) == fail_at:
            raise OSError(errno.EINVAL, "Invalid argument")
        calls.append((offset, len(view), ctypes.addressof(ctypes.c_char.from_buffer(view))))
        real(fd, view, offset)

    monkeypatch.setattr(diskio, "_pwrite_direct", record)
    return calls


def _append(path: Path, head: bytes, chunks: list[bytes], buffer_bytes: int):
    """``head`` written normally, then ``chunks`` through ``DirectAppend``; returns it, closed."""
    with open(path, "wb") as f:
        f.write(head)
        f.flush()
        out = diskio.DirectAppend(path, f.fileno(), len(head), buffer_bytes)
        for c in chunks:
            out.write(torch.frombuffer(bytearray(c), dtype=torch.uint8))
        assert out.close() == len(head) + sum(map(len, chunks))
        os.fsync(f.fileno())
    return out


@pytest.mark.parametrize("mode", ["direct", "refused at open", "refused at the first write", "refused at the third write"])
def test_direct_append_writes_the_same_bytes_with_or_without_o_direct(tmp_path, monkeypatch, mode):
    """``DirectAppend`` (the GGUF export's data): the file holds the head and every chunk in order
    whether O_DIRECT is taken, refused by the filesystem at open (tmpfs before Linux 6.6, some FUSE)
    or at a write (EINVAL: the rest goes through the page cache). O_DIRECT writes are whole aligned
    blocks from an aligned buffer, the head's partial block rewritten as it was; only the tail after
    the last whole block goes through the ordinary descriptor."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    fail_at = {"refused at the first write": 0, "refused at the third write": 2}.get(mode)
    calls = _direct_writes(monkeypatch, fail_at)
    if mode == "refused at open":
        monkeypatch.setattr(diskio, "_open_direct", lambda path: None)
    head = os.urandom(5000)  # not a whole block: the first block is part head, part data
    rng = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 20_000, (40,), generator=rng)] + [3 * 4096, 1]
    chunks = [os.urandom(n) for n in sizes]
    path = tmp_path / "f.bin"
    out = _append(path, head, chunks, buffer_bytes=4 * 4096)
    assert path.read_bytes() == head + b"".join(chunks)
    if out.direct is False and mode == "direct":
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: only the fallback ran")
    assert all(offset % 4096 == 0 and n % 4096 == 0 and address % 4096 == 0 for offset, n, address in calls)
    if mode == "direct":
        assert out.direct and calls[0][0] == 4096 * (len(head) // 4096)
        covered = sum(n for _, n, _ in calls)
        assert calls[-1][0] + calls[-1][1] == calls[0][0] + covered > len(head) + sum(sizes) - 4096  # contiguous; the tail < 1 block
    else:
        assert not out.direct and len(calls) == (fail_at or 0)


def test_page_cache_advice_names_its_range_and_kind(monkeypatch):
    """``drop_cached`` is DONTNEED and ``read_ahead`` WILLNEED, each on exactly the range given."""
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((fd, offset, length, advice)), raising=False)
    monkeypatch.setattr(os, "POSIX_FADV_DONTNEED", 4, raising=False)
    monkeypatch.setattr(os, "POSIX_FADV_WILLNEED", 3, raising=False)
    diskio.drop_cached(7, 4096, 1 << 20)
    diskio.read_ahead(7, 1 << 20, 1 << 16)
    assert calls == [(7, 4096, 1 << 20, 4), (7, 1 << 20, 1 << 16, 3)]
    assert diskio.can_advise()
    monkeypatch.delattr(os, "posix_fadvise")  # another platform: no advice, and WriteBack leaves it to the fsync
    assert not diskio.can_advise()
    diskio.WriteBack(7).written(1 << 30)
