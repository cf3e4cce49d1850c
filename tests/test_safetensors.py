import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimtune.checkpoint.stream import tensor_source
from slimtune.checkpoint.writer import WriteOptions, write_safetensors
from slimtune.errors import SlimtuneError
from slimtune.formats.safetensors import SafetensorsReader, read_header
from slimtune.tensors import StreamTensor


def stream_of(tensors: dict[str, torch.Tensor]) -> list[StreamTensor]:
    return [tensor_source(k, v) for k, v in tensors.items()]


def test_streamed_file_reads_back_with_the_reference_library(tmp_path):
    tensors = {
        "a": torch.randn(7, 5).to(torch.bfloat16),
        "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "c": torch.randn(3),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "x.safetensors"
    record = write_safetensors(path, stream_of(tensors), WriteOptions(chunk_bytes=16, progress=False))  # "a": a row a chunk
    loaded = load_file(path)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v), k
    assert path.stat().st_size == record.size and record.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_writer_refuses_wrong_dtype_excess_bytes_and_a_short_stream(tmp_path):
    def source(rows):
        return [StreamTensor("a", (2, 2), torch.float32, rows)]

    options = WriteOptions(progress=False)
    with pytest.raises(SlimtuneError, match="tensor a: got torch.bfloat16"):
        write_safetensors(tmp_path / "d.safetensors", source(lambda s, e: torch.zeros(e - s, 2, dtype=torch.bfloat16)), options)
    with pytest.raises(SlimtuneError, match="tensor a: more bytes"):
        write_safetensors(tmp_path / "m.safetensors", source(lambda s, e: torch.zeros(e - s + 1, 2)), options)
    with pytest.raises(SlimtuneError, match="tensor a: the stream ended before its rows were written"):
        write_safetensors(tmp_path / "s.safetensors", source(lambda s, e: torch.zeros(0, 2)), options)


def test_reader_reads_row_ranges_of_reference_files(tmp_path):
    t = torch.randn(10, 6)
    save_file({"w": t, "v": torch.ones(4, dtype=torch.float16)}, tmp_path / "r.safetensors")
    with SafetensorsReader(tmp_path / "r.safetensors") as r:
        assert torch.equal(r.read("w", 3, 8), t[3:8])
        assert torch.equal(r.read("w"), t)
        buf = torch.empty(2, 6)
        assert r.read("w", 0, 2, out=buf) is buf
        with pytest.raises(SlimtuneError, match="no tensor named 'x'"):
            r.read("x")


def test_drop_behind_lets_go_of_exactly_the_ranges_read(tmp_path, monkeypatch):
    """A read-once stream (the merge's base) drops what it read from the page cache, range by range, and
    the data is unchanged; without the option nothing is dropped."""
    import os

    t = torch.randn(10, 6)
    save_file({"w": t}, tmp_path / "r.safetensors")
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append((off, n, advice)))
    with SafetensorsReader(tmp_path / "r.safetensors") as r:
        r.read("w")
    assert dropped == []
    with SafetensorsReader(tmp_path / "r.safetensors", drop_behind=True) as r:
        start = r.header.data_start + r.entry("w").begin
        assert torch.equal(r.read("w", 3, 8), t[3:8])
        assert torch.equal(r.read("w"), t)
    assert [d for d in dropped if d[2] == os.POSIX_FADV_DONTNEED] == [
        (start + 3 * 24, 5 * 24, os.POSIX_FADV_DONTNEED),
        (start, 10 * 24, os.POSIX_FADV_DONTNEED),
    ]


def test_a_read_once_stream_has_the_kernel_read_ahead_of_it_once_per_half_window(tmp_path, monkeypatch):
    """drop_behind's stream asks for the READ_AHEAD bytes after each read (POSIX_FADV_WILLNEED), topped up
    only once half of the window was consumed, each byte asked for once; a plain reader asks for nothing."""
    import os

    import slimtune.formats.safetensors as st

    t = torch.randn(64, 8)  # rows of 32 bytes
    save_file({"w": t}, tmp_path / "r.safetensors")
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((off, n, advice)))
    monkeypatch.setattr(st, "READ_AHEAD", 256)
    with SafetensorsReader(tmp_path / "r.safetensors") as r:
        r.read("w")
    assert advised == []
    with SafetensorsReader(tmp_path / "r.safetensors", drop_behind=True) as r:
        start = r.header.data_start + r.entry("w").begin
        for row in range(0, 64, 2):
            assert torch.equal(r.read("w", row, row + 2), t[row : row + 2])
    ahead = [(off, n) for off, n, advice in advised if advice == os.POSIX_FADV_WILLNEED]
    assert ahead[0] == (start + 64, 256)  # the first read (64 bytes), then the window after it
    for (off, n), (next_off, next_n) in zip(ahead, ahead[1:], strict=False):
        assert next_off == off + n  # contiguous: nothing asked for twice, no hole
        assert 128 <= next_n <= 256  # topped up by at least half a window: not a call per read
    assert len(ahead) < 32 / 2  # 32 reads
    assert ahead[-1][0] + ahead[-1][1] >= start + 64 * 32  # the whole tensor was asked for ahead of its reads


def test_header_checks_catch_truncation_and_lying_offsets(tmp_path):
    good = tmp_path / "g.safetensors"
    save_file({"w": torch.randn(8, 8), "b": torch.randn(8)}, good)
    raw = good.read_bytes()

    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(raw[:-10])
    with pytest.raises(SlimtuneError, match="t.safetensors.*truncated"):
        read_header(truncated)

    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["w"]["data_offsets"][1] += 4  # claims more bytes than its shape holds
    body = json.dumps(header).encode()
    lying = tmp_path / "l.safetensors"
    lying.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(SlimtuneError, match="tensor w: offsets"):
        read_header(lying)

    tiny = tmp_path / "n.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(SlimtuneError, match="not a safetensors file"):
        read_header(tiny)


def test_buffer_pool_reuses_buffers_and_bounds_memory():
    from slimtune.checkpoint.staging import BufferPool

    pool = BufferPool(1024, 2)
    assert pool.free.qsize() == 0 and pool.unallocated == 2  # nothing allocated before first use
    a = pool.take((16, 8), torch.float32)  # 512 bytes
    b = pool.take((256,), torch.int32)  # 1024 bytes
    assert pool.free.qsize() == 0 and pool.unallocated == 0
    a.fill_(1.0)
    del a
    assert pool.free.qsize() == 1  # returned as soon as nothing views it
    c = pool.take((4,), torch.bfloat16)
    assert pool.free.qsize() == 0 and c.is_contiguous()
    big = pool.take((1025,), torch.uint8)  # larger than a buffer: a fresh allocation, no wait
    assert big.numel() == 1025
    del b, c
    assert pool.free.qsize() == 2
