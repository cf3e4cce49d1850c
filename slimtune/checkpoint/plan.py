"""The save plan: which bytes go where, from shapes alone, before any byte is made. Every rank computes
the same plan (as DCP's SavePlanner does), so no rank has to send another one a header or an offset:
files (the PEFT adapter, then the Hugging Face shards, packed greedily as transformers does), each
file's header, every tensor's absolute byte offset, and the rows each rank writes.

Tensor order is canonical, decided here from names and dtypes alone, whatever order a stream comes in
(the model's for the in-training save, the base files' for the offline merge): so the save, the merge
and every rank of a distributed export write the same bytes. Tensors are packed into shards in natural
order of their names (digit runs compared as numbers: ``layers.2`` before ``layers.10``, so each shard
holds whole consecutive layers, as a reader of the index expects); inside each file they are laid out
by element size, largest first, then in the same natural order (the safetensors reference's
``serialize`` rule, with its lexical order made natural), which keeps every tensor aligned to its
element size. For the usual single-dtype checkpoint both orders are the natural name order.

Rows are split as FSDP2 shards dim 0 (``split_rows``), so a rank of a sharded model writes exactly the
rows it holds; a tensor below ``whole_below`` bytes (and every 0-d tensor) is written whole by one owner
rank, taken round-robin. Example::

    plan = plan_save(merged_stream, adapter_stream, max_shard_bytes=5 * 10**9, world_size=2)
    plan.files[0].path, plan.files[0].size, plan.files[0].slots[0].ranges  # the same on every rank
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch

from slimtune.distributed import split_rows
from slimtune.formats.hf import shard_name
from slimtune.formats.layout import ADAPTER_WEIGHTS_PATH
from slimtune.formats.safetensors import build_header
from slimtune.tensors import StreamTensor, dtype_size

SAFETENSORS_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in its file and who writes which of its rows."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute offset of the tensor's first byte in the file (header included)."""
    row_bytes: int
    ranges: tuple[tuple[int, int], ...]
    """Rows [start, end) written by each rank, indexed by rank."""
    source: StreamTensor = field(compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


@dataclass(frozen=True)
class FilePlan:
    path: str
    """Relative to the checkpoint directory."""
    header: bytes
    size: int
    slots: tuple[TensorSlot, ...]

    def bytes_of(self, rank: int) -> int:
        """Tensor bytes this rank writes into the file."""
        return sum((s.ranges[rank][1] - s.ranges[rank][0]) * s.row_bytes for s in self.slots)

    def sole_writer(self, world_size: int) -> int | None:
        """The rank that writes every tensor byte (it can hash the file while writing it), if one does."""
        data = self.size - len(self.header)
        for rank in range(world_size):
            if self.bytes_of(rank) == data:
                return rank
        return None


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]
    weight_map: dict[str, str]
    """Merged tensor name -> shard file (the Hugging Face index); empty without merged tensors."""
    merged_bytes: int
    world_size: int
    hashers: tuple[int, ...]
    """Per file, the rank that computes its sha256: the sole writer while writing, otherwise one rank
    that reads the file back after every rank has written it (largest files first to the least loaded)."""

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def bytes_of(self, rank: int) -> int:
        return sum(f.bytes_of(rank) for f in self.files)

    def read_back_bytes(self, rank: int) -> int:
        """Bytes ``rank`` reads back to hash files it did not write whole."""
        return sum(f.size for f, h in zip(self.files, self.hashers, strict=True) if h == rank and f.sole_writer(self.world_size) != rank)

    def digest(self) -> str:
        """A fingerprint of everything that decides the bytes' places: equal on every rank or the job stops."""
        h = hashlib.sha256(str(self.world_size).encode())
        for f in self.files:
            h.update(f"{f.path}\0{f.size}\0".encode())
            h.update(f.header)
            for s in f.slots:
                h.update(f"{s.name}\0{s.offset}\0{s.ranges}\0".encode())
        return h.hexdigest()


def natural_key(name: str) -> tuple:
    """Sort key of a tensor name with its digit runs compared as numbers (``layers.2`` < ``layers.10``);
    the name itself breaks ties (``01`` vs ``1``)."""
    parts = re.split(r"(\d+)", name)  # even positions text, odd positions digits: comparable position by position
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


def shard_order(tensors: list[StreamTensor]) -> list[StreamTensor]:
    """The order tensors are packed into shards in: natural order of their names."""
    return sorted(tensors, key=lambda t: natural_key(t.name))


def file_order(tensors: list[StreamTensor]) -> list[StreamTensor]:
    """The order of tensors inside one file: element size, largest first, then natural name order."""
    return sorted(tensors, key=lambda t: (-dtype_size(t.dtype), natural_key(t.name)))


def _pack(stream: list[StreamTensor], max_shard_bytes: int) -> list[list[StreamTensor]]:
    """Greedy packing in the given order, as transformers does: a tensor larger than the limit gets a shard alone."""
    shards: list[list[StreamTensor]] = [[]]
    size = 0
    for t in stream:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def plan_save(
    merged: list[StreamTensor],
    adapter: list[StreamTensor] | None,
    max_shard_bytes: int,
    world_size: int = 1,
    whole_below: int = 0,
) -> SavePlan:
    """The plan for a checkpoint of ``adapter`` (PEFT weights, if given) and ``merged`` (HF shards), in
    the canonical order (module docstring) whatever the order of the streams."""
    groups: list[tuple[str, list[StreamTensor]]] = []
    if adapter is not None:
        groups.append((ADAPTER_WEIGHTS_PATH, adapter))
    shards = _pack(shard_order(merged), max_shard_bytes)
    groups += [(shard_name(i, len(shards)), tensors) for i, tensors in enumerate(shards)]
    return plan_files(groups, world_size, whole_below, sum(t.nbytes for t in merged))


def plan_files(groups: list[tuple[str, list[StreamTensor]]], world_size: int = 1, whole_below: int = 0, merged_bytes: int = 0) -> SavePlan:
    """The plan for safetensors files given as (relative path, tensors); each file's tensors are laid out
    in ``file_order``."""
    owner = 0
    files = []
    for path, tensors in groups:
        tensors = file_order(tensors)
        header, entries = build_header([(t.name, t.dtype, t.shape) for t in tensors], SAFETENSORS_METADATA)
        slots = []
        for t, entry in zip(tensors, entries, strict=True):
            if not t.shape or t.nbytes < whole_below:
                ranges = tuple((0, t.num_rows) if r == owner else (0, 0) for r in range(world_size))
                owner = (owner + 1) % world_size
            else:
                ranges = split_rows(t.num_rows, world_size)
            slots.append(TensorSlot(t.name, t.dtype, tuple(t.shape), len(header) + entry.begin, t.row_bytes, ranges, t))
        files.append(FilePlan(path, header, len(header) + (entries[-1].end if entries else 0), tuple(slots)))
    hashers, load = [], [0] * world_size
    for f in files:
        sole = f.sole_writer(world_size)
        hashers.append(sole if sole is not None else -1)
    for i in sorted((i for i, h in enumerate(hashers) if h < 0), key=lambda i: (-files[i].size, i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        hashers[i] = rank
        load[rank] += files[i].size
    weight_map = {s.name: f.path for f in files if f.path != ADAPTER_WEIGHTS_PATH for s in f.slots}
    return SavePlan(tuple(files), weight_map, merged_bytes, world_size, tuple(hashers))
