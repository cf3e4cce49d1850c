"""checkpoint/plan.py and the stream's row chunks, on synthetic streams (shapes only: no model, no disk)."""

from __future__ import annotations

import json
import struct

import torch

from slimtune.checkpoint.plan import ADAPTER_WEIGHTS_PATH, natural_key, plan_files, plan_save
from slimtune.tensors import StreamTensor, dtype_size, row_chunks, scalar_source


def _tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> StreamTensor:
    def rows(a: int, b: int) -> torch.Tensor:
        base = torch.arange(a, b, dtype=torch.float32).reshape(-1, *([1] * (len(shape) - 1)))
        return base.expand(b - a, *shape[1:]).to(dtype).contiguous()

    return StreamTensor(name, shape, dtype, rows)


def _header(plan_file) -> dict:
    (n,) = struct.unpack("<Q", plan_file.header[:8])
    return json.loads(plan_file.header[8 : 8 + n])


def test_offsets_follow_the_header_and_each_other():
    (f,) = plan_files([("one.safetensors", [_tensor("b", (3, 4)), _tensor("a", (2, 4))])]).files
    header = _header(f)
    assert len(f.header) % 8 == 0  # the JSON is padded with spaces to a multiple of 8
    assert [s.name for s in f.slots] == ["a", "b"]  # natural name order inside the file
    for slot in f.slots:
        begin, end = header[slot.name]["data_offsets"]
        assert slot.offset == len(f.header) + begin and end - begin == slot.nbytes
    assert f.slots[1].offset == f.slots[0].offset + f.slots[0].nbytes
    assert f.size == len(f.header) + sum(s.nbytes for s in f.slots)


def test_larger_elements_first_keeps_every_tensor_aligned():
    tensors = [_tensor("z.half", (3, 5)), _tensor("a.mask", (3,), torch.bool), _tensor("m.fp32", (3, 3), torch.float32)]
    (f,) = plan_files([("mixed.safetensors", tensors)]).files
    assert [s.name for s in f.slots] == ["m.fp32", "z.half", "a.mask"]  # by element size, then name
    for slot in f.slots:
        assert slot.offset % dtype_size(slot.dtype) == 0, slot.name


def test_shards_pack_in_natural_order_and_a_large_tensor_gets_a_shard_alone():
    layers = [_tensor(f"model.layers.{i}.w", (4, 8)) for i in (10, 2, 1)]  # 64 bytes each
    big = _tensor("model.layers.3.big", (16, 8))  # 256 bytes: over the limit by itself
    plan = plan_save([*layers, big], None, max_shard_bytes=150)
    names = [[s.name for s in f.slots] for f in plan.files]
    assert names == [["model.layers.1.w", "model.layers.2.w"], ["model.layers.3.big"], ["model.layers.10.w"]]
    assert [f.path for f in plan.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan.weight_map["model.layers.10.w"] == "model-00003-of-00003.safetensors"
    assert plan.merged_bytes == 3 * 64 + 256
    assert natural_key("layers.2") < natural_key("layers.10")


def test_the_adapter_file_comes_first_and_stays_out_of_the_index():
    plan = plan_save([_tensor("w", (4, 4))], [_tensor("w.lora_A.weight", (2, 4), torch.float32)], max_shard_bytes=10**9)
    assert plan.files[0].path == ADAPTER_WEIGHTS_PATH
    assert plan.weight_map == {"w": "model-00001-of-00001.safetensors"} and plan.files[1].path == "model-00001-of-00001.safetensors"
    assert "w.lora_A.weight" not in plan.weight_map


def test_rank_ranges_split_rows_as_fsdp2_and_small_tensors_go_whole_round_robin():
    big, small_a, small_b = _tensor("big", (10, 4)), _tensor("small_a", (2, 4)), _tensor("small_b", (2, 4))
    plan = plan_files([("f.safetensors", [big, small_a, small_b])], world_size=3, whole_below=17)
    ranges = {s.name: s.ranges for s in plan.files[0].slots}
    assert ranges["big"] == ((0, 4), (4, 8), (8, 10))  # torch.chunk's split: ceil(10 / 3) rows per rank
    assert ranges["small_a"] == ((0, 2), (0, 0), (0, 0)) and ranges["small_b"] == ((0, 0), (0, 2), (0, 0))
    f = plan.files[0]
    assert sum(f.bytes_of(r) for r in range(3)) == f.size - len(f.header)
    assert f.sole_writer(3) is None and plan.hashers[0] in range(3)
    one = plan_files([("f.safetensors", [big])], world_size=1)
    assert one.files[0].sole_writer(1) == 0 and one.read_back_bytes(0) == 0


def test_the_same_plan_whatever_the_stream_order():
    tensors = [_tensor(f"layers.{i}.w", (4, 4)) for i in range(5)]
    a = plan_save(tensors, None, 100, world_size=2)
    b = plan_save(list(reversed(tensors)), None, 100, world_size=2)
    assert a.digest() == b.digest()
    assert a.digest() != plan_save(tensors, None, 100, world_size=1).digest()


def test_row_chunks_cover_exactly_the_asked_rows():
    t = _tensor("w", (10, 4))  # 8 bytes per row
    chunks = list(row_chunks(t, chunk_bytes=24, start=1, end=9))
    assert [c.shape[0] for c in chunks] == [3, 3, 2]
    assert torch.equal(torch.cat(chunks)[:, 0], torch.arange(1, 9, dtype=torch.bfloat16))
    assert [c.shape[0] for c in row_chunks(t, chunk_bytes=1)] == [1] * 10  # at least one row per chunk
    scalar = StreamTensor("s", (), torch.float32, lambda a, b: torch.tensor(2.0))
    assert [c.item() for c in row_chunks(scalar, 1024)] == [2.0]
    empty = StreamTensor("e", (2**40, 0), torch.bfloat16, lambda a, b: torch.empty((b - a, 0), dtype=torch.bfloat16))
    assert len(list(row_chunks(empty, 1024))) == 1  # an empty tensor is one chunk, never 2**40 of them


def test_a_scalar_source_is_one_cpu_value_whatever_rows_are_asked():
    t = scalar_source("s", torch.bfloat16, lambda: torch.tensor([3.0], dtype=torch.float64))
    assert (t.shape, t.num_rows, t.nbytes) == ((), 1, 2)
    [chunk] = list(row_chunks(t, chunk_bytes=1))
    assert chunk.shape == () and chunk.dtype == torch.bfloat16 and chunk.device.type == "cpu" and float(chunk) == 3.0
