"""A save point's snapshot on its way to a writer and back into a checkpoint: host copies of the
training state (``tree_to_host``; a DTensor travels as its local ``Shard``), the DTensors rebuilt on the
writers' mesh (``rebuild``), and ``write_request``: one checkpoint from one ``Request`` by the one save
path (``CheckpointManager.save``), answered ``Done`` or ``Failed``."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from slimtune.checkpoint.background.protocol import Done, Failed, Request
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import ExtraFile
from slimtune.distributed import PeerFailure, Ranks, device_mesh, is_dtensor
from slimtune.errors import SlimtuneError
from slimtune.memory import peak_rss_mb, private_mb, reset_peak_rss


@dataclass(frozen=True)
class Shard:
    """A DTensor in a snapshot: this rank's local shard and what rebuilds it on the writers' mesh."""

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple


def tree_to_host(tree: object) -> object:
    """The tensors of ``tree`` copied off a GPU into pinned host buffers (asynchronously, then one
    synchronisation); CPU tensors as they are (serialising copies them); a DTensor as its local shard
    (``Shard``), which the writer rebuilds on its own mesh (``rebuild``)."""
    copies = []

    def host(x: torch.Tensor) -> torch.Tensor:
        if type(x) is not torch.Tensor:
            raise SlimtuneError(f"checkpoint.async: a {type(x).__name__} in the training state (expected tensors and DTensors)")
        if not x.is_cuda:
            return x
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out.copy_(x, non_blocking=True)
        copies.append(x.device)
        return out

    def leaf(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        if is_dtensor(x):
            return Shard(host(x.to_local()), tuple(x.shape), tuple(x.stride()), tuple(x.placements))
        return host(x)

    out = pytree.tree_map(leaf, tree)
    for device in set(copies):
        torch.cuda.synchronize(device)
    return out


def rebuild(tree: object, ranks: Ranks) -> object:
    """A snapshot's ``Shard`` entries as DTensors again, on the writers' mesh (the same shapes and
    placements: DCP writes them as the trainers' would)."""

    def leaf(x: object) -> object:
        if not isinstance(x, Shard):
            return x
        from torch.distributed.tensor import DTensor  # a snapshot with shards comes from a process group

        return DTensor.from_local(x.local, device_mesh(ranks), x.placements, run_check=False, shape=x.shape, stride=x.stride)

    return pytree.tree_map(leaf, tree)


def write_request(
    model: nn.Module, manager: CheckpointManager, request: Request, ranks: Ranks, params: dict | None = None, own_process: bool = True
) -> Done | Failed:
    """One checkpoint from one snapshot, by the one save path (every writer its part under a process
    group); ``params``: the writer's own model's parameters, into which the snapshot's adapters go
    first (a forked writer's model is the trainer's). Not ``own_process`` (a save in the trainer's
    process): its peak RSS is not reset, and no memory is the writer's own."""
    started = time.perf_counter()
    if own_process:
        reset_peak_rss()
    try:
        with torch.no_grad():
            for name, value in request.train_state["adapter"].items() if params is not None else ():
                target = params[name].to_local() if is_dtensor(params[name]) else params[name]
                target.copy_(value.local if isinstance(value, Shard) else value)
        train_state = rebuild(request.train_state, ranks)
        extra = {name: ExtraFile(len(data), partial(_write_bytes, data)) for name, data in request.extra.items()}
        options = dataclasses.replace(request.options, extra_files=extra, file_lanes=1)  # the cores are training's
        result = manager.save(model, request.step, request.state, options, train_state, ranks)
    except SlimtuneError as e:
        return Failed(str(e), own=not isinstance(e, PeerFailure))
    except Exception as e:  # noqa: BLE001 - one line for the trainer
        return Failed(f"the checkpoint writer failed writing {request.name}: {type(e).__name__}: {e}", own=True)
    return Done(time.perf_counter() - started, result.total_bytes, peak_rss_mb(), private_mb() if own_process else 0.0)


def _write_bytes(data: bytes, path: Path) -> None:
    path.write_bytes(data)
