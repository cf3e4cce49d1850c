"""Many processes, in one small module (as gpt-fast keeps tensor parallelism in ``tp.py``): process-group
set-up under torchrun (NCCL on CUDA, gloo on CPU), who the coordinator is, and the few collectives the
cooperative writer needs. A single process is the world of size 1: every call below works without
``torch.distributed`` being initialised, so callers have one code path.

Example::

    ranks = init_distributed("cpu")      # under torchrun: a gloo group; alone: Ranks(0, 1)
    if ranks.is_coordinator:
        manager.prepare(...)             # only rank 0 writes the run directory's own files
    ranks.agree(None, "the export")      # raises on every rank if any rank reports an error
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slimtune.errors import SlimtuneError, first_line
from slimtune.lora import qlora_linears
from slimtune.quant import is_nf4
from slimtune.runtime import decoder_layers

log = logging.getLogger(__name__)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job. ``group`` carries the control messages (a gloo group, also
    when training runs on NCCL: objects and barriers then never touch the GPU)."""

    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    distributed: bool = False  # a process group is up (torchrun, also with one process): models are FSDP2-sharded

    @property
    def device_type(self) -> str:
        """Where FSDP2 puts the shards: cuda under NCCL, else cpu."""
        return "cuda" if self.distributed and dist.get_backend() == "nccl" else "cpu"

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 creates directories, writes the small files and the manifest, and prints."""
        return self.rank == 0

    def gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, on every rank (picklable objects; small ones)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise _lost(self.rank, what, e) from None
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        """The coordinator's ``obj``, on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise _lost(self.rank, what, e) from None
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """A barrier that also carries each rank's outcome: if any rank failed, every rank raises a
        SlimtuneError naming the first failed rank and its error (the failed rank re-raises its own)."""
        statuses = self.gather(None if error is None else f"{type(error).__name__}: {error}", what)
        if error is not None:
            raise error
        for r, status in enumerate(statuses):
            if status is not None:
                raise PeerFailure(f"rank {r} failed during {what}: {status}")


SINGLE = Ranks()


class PeerFailure(SlimtuneError):
    """Raised on a rank for another rank's failure (``Ranks.agree``) or a peer lost mid-collective: the
    cause lies elsewhere, so a caller choosing which of several ranks' errors to report prefers others."""


def _lost(rank: int, what: str, e: BaseException) -> SlimtuneError:
    first = first_line(e)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's source location and advice off
    return PeerFailure(f"rank {rank}: lost contact with the other ranks during {what} (did one die?): {first}")


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or anything that sets its environment variables)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def current_ranks() -> Ranks:
    """The job as torch.distributed sees it now (Ranks(0, 1) when it is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    return Ranks(dist.get_rank(), dist.get_world_size(), _control_group(), distributed=True)


_CONTROL: dict[str, Any] = {}


def _control_group() -> Any:
    if dist.get_backend() == "gloo":
        return None  # the default group already is gloo
    if "group" not in _CONTROL:
        _CONTROL["group"] = dist.new_group(backend="gloo")
    return _CONTROL["group"]


def init_distributed(device: str = "cpu", timeout_s: float = 1800.0) -> Ranks:
    """Under torchrun: join the process group (NCCL when ``device`` is CUDA, gloo otherwise), bind
    this rank to its local GPU, and turn torchrun's SIGTERM (sent when another rank died) into an
    exception, so temporary files are cleaned up and one line is printed. Alone: ``Ranks(0, 1)``."""
    if not launched_by_torchrun():
        return SINGLE
    if not dist.is_initialized():
        cuda = str(device).startswith("cuda")
        if cuda:
            local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local >= gpus:
                raise SlimtuneError(
                    f"rank {os.environ.get('RANK', '?')}: local rank {local} needs GPU {local}, this host has {gpus}; "
                    "start at most one process per GPU (or use device=cpu)"
                )
            torch.cuda.set_device(local)
        join_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        raise_on_sigterm(f"rank {os.environ.get('RANK', '?')}: stopped by SIGTERM (torchrun stops every rank when one fails)")
    return current_ranks()


def join_group(**kwargs: Any) -> None:
    """``dist.init_process_group(**kwargs)``, with ``torch.distributed.nn`` imported first. That module
    binds ``group.WORLD`` as its functions' default argument when it is imported; imported after the
    group exists (torch's dynamo pulls it in through FSDP on first use), those defaults keep the gloo
    group alive after ``destroy_process_group``. Its worker threads then still hold their last work at
    interpreter exit, and freeing its tensors there aborts the process ("terminate called without an
    active exception", now and then under load). Imported first, the defaults are
    None and ``shutdown`` ends the group's threads.

    Example: ``join_group(backend="gloo", store=store, rank=0, world_size=2)``"""
    import torch.distributed.nn  # noqa: F401 - see above: before the group exists

    dist.init_process_group(**kwargs)


_SIGTERM: dict[str, Any] = {"message": None, "deferred": 0, "pending": False}


def raise_on_sigterm(message: str) -> None:
    """From now on SIGTERM raises ``SlimtuneError(message)`` in the main thread, so ``finally`` blocks
    and ``atomic_directory`` clean up; inside ``sigterm_deferred`` blocks it waits until the block ends.

    Example: ``raise_on_sigterm("rank 1: stopped by SIGTERM")``"""
    _SIGTERM["message"] = message
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if _SIGTERM["deferred"]:
        _SIGTERM["pending"] = True
        return
    raise SlimtuneError(_SIGTERM["message"])


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """A clean-up that must run to its end (removing a temporary directory): a SIGTERM that arrives
    inside waits, and is raised at the end unless an exception is already on its way (torchrun sends
    SIGTERM to the surviving ranks while they clean up after a lost peer; raised mid-``rmtree`` it left
    the temporary directory behind).

    Example: ``with sigterm_deferred(): shutil.rmtree(tmp, ignore_errors=True)``"""
    _SIGTERM["deferred"] += 1
    try:
        yield
    finally:
        _SIGTERM["deferred"] -= 1
    if not _SIGTERM["deferred"] and _SIGTERM["pending"]:
        _SIGTERM["pending"] = False
        if sys.exc_info()[0] is None:
            raise SlimtuneError(_SIGTERM["message"])


def shutdown(wait: bool = False) -> None:
    """Leave the process group (no-op when there is none). With ``wait`` (the job succeeded) a barrier
    first, so that no rank tears its connections down while another still finishes a collective; after a
    failure the group is destroyed at once (a peer may be gone)."""
    if dist.is_available() and dist.is_initialized():
        if wait:
            try:
                dist.barrier(group=_CONTROL.get("group"))
            except (RuntimeError, ValueError):
                pass  # another rank is gone already: nothing to wait for
        dist.destroy_process_group()
    _CONTROL.clear()


def split_rows(num_rows: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """Each rank's rows [start, end) of a tensor, as FSDP2 shards dim 0 (``torch.chunk``: ceil(n / w)
    rows per rank, the last ranks possibly short or empty), so a rank's shard and its rows agree."""
    per = -(-num_rows // world_size) if num_rows else 0
    return tuple((min(r * per, num_rows), min((r + 1) * per, num_rows)) for r in range(world_size))


def all_sum(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``value`` summed over the ranks (itself in one process).

    Example: ``tokens = all_sum(torch.tensor(float(count)), ranks).item()``"""
    if ranks.distributed and ranks.world_size > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def run_ranks(nproc: int, args: list[str]) -> int:
    """Run ``python -m slimtune ARGS`` as ``nproc`` local ranks with torch's elastic launcher (what
    ``torchrun --standalone --nproc-per-node N`` runs): if any rank fails or is killed, the others are
    stopped. Returns 0, or a non-zero code after printing one line naming the failed rank(s).

    Example: ``run_ranks(2, ["merge", "--base", "b", "--adapter", "a", "--out", "o"])``."""
    # torch's elastic launcher: only for `--nproc N`, so a one-process command does not import it
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # one line below says which rank failed
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "slimtune", *args)
    except ChildFailedError as e:
        parts = []
        for rank, failure in sorted(e.failures.items()):
            code = failure.exitcode
            parts.append(f"rank {rank} " + (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"))
        log.error(f"slimtune {args[0]}: {nproc} ranks: {', '.join(parts)}")  # on stderr, configured or not
        return 2 if any(f.exitcode == 2 for f in e.failures.values()) else 1
    return 0


def shard_model(model: torch.nn.Module, ranks: Ranks, keep_whole: set[torch.nn.Parameter] = frozenset()) -> torch.nn.Module:
    """FSDP2 as torchtune and torchtitan apply it: ``fully_shard`` on every decoder layer, then on the
    root. Every parameter (NF4 base weights, fp32 adapters, embeddings, norms) becomes a DTensor
    sharded on dim 0 (``split_rows``); torchao's NF4Tensor implements the ops FSDP2 needs. Parameters
    still on the meta device stay meta DTensors, to be filled shard by shard (``load_qlora_model``);
    real ones must be the same on every rank. No mixed-precision policy: each rank computes in the
    dtypes a single process would (NF4 dequantized to the activations' bf16, fp32 adapters).
    Gradients are summed over the ranks, not averaged: the recipe's loss is already the token mean
    over the whole global step. ``keep_whole``: frozen parameters FSDP2 leaves alone (held whole on every
    rank, moved to the device by the caller); NF4 weights already quantized that do not cut into equal
    parts of whole scaler blocks (``unsplittable_nf4``) are always among them. Under a process group of one rank it shards too (one
    shard: the same code path); alone it does nothing."""
    if not (dist.is_available() and dist.is_initialized()):
        return model
    # FSDP2 and device meshes only under a process group: a one-process run or merge never loads them
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh(ranks)
    layers = decoder_layers(model)
    if not layers:
        raise SlimtuneError(f"{type(model).__name__}: no decoder layers found to shard")
    ignored = set(keep_whole) | unsplittable_nf4(model, ranks.world_size)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    for module in [*layers, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def device_mesh(ranks: Ranks) -> Any:
    """The one-dimensional device mesh over the job's ranks that FSDP2 shards on, made once per process.

    Example: ``DTensor.from_local(local, device_mesh(ranks), [Shard(0)], run_check=False)``"""
    if "mesh" not in _CONTROL:
        from torch.distributed.device_mesh import init_device_mesh  # only under a process group (see shard_model)

        _CONTROL["mesh"] = init_device_mesh(ranks.device_type, (ranks.world_size,))
    return _CONTROL["mesh"]


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters FSDP2 keeps after a forward pass without backward (evaluation,
    generation under no_grad: the root keeps its own gathered), so the next training step gathers
    afresh; without it the next backward fails. Alone, or unsharded: nothing to do."""
    from torch.distributed.fsdp import FSDPModule  # FSDP2: see shard_model

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def nf4_splits(shape: tuple[int, ...], world_size: int) -> bool:
    """Whether FSDP2 can cut an NF4 weight of ``shape`` among ``world_size`` ranks: torchao splits it into
    equal parts of whole scaler blocks (64 x ``scaler_block_size(shape)`` elements, the tensor's own), so
    the rows and the number of those blocks must both divide by the number of ranks. With one rank there is
    nothing to cut, and FSDP2's one-rank gather does not hand torchao's NF4 its parts (torchao 0.18: the
    forward fails), so: no."""
    from slimtune.quant.nf4 import BLOCK_SIZE, scaler_block_size  # torchao (~80 MB): only where NF4 weights are sharded

    sbs = scaler_block_size(tuple(shape))
    if world_size <= 1 or sbs is None:
        return False
    scaler_blocks = shape[0] * shape[1] // (BLOCK_SIZE * sbs)
    return shape[0] % world_size == 0 and scaler_blocks % world_size == 0


def unsplittable_nf4(model: torch.nn.Module, world_size: int) -> set[torch.nn.Parameter]:
    """The NF4 weights FSDP2 cannot cut into ``world_size`` equal parts of whole scaler blocks
    (``nf4_splits``): torchao NF4 tensors, and QLoRA targets still on the meta device that loading will
    quantize. They are held whole on every rank (frozen, they have no gradient to reduce; only toy
    models have them).

    Example: ``whole = unsplittable_nf4(model, ranks.world_size)``"""
    from slimtune.quant.nf4 import can_quantize  # torchao (~80 MB): only where a model is sharded

    nf4 = [p for p in model.parameters() if is_nf4(p)]
    nf4 += [m.weight for m in qlora_linears(model).values() if m.weight.is_meta and can_quantize(m.weight.shape)]
    return {p for p in nf4 if not nf4_splits(tuple(p.shape), world_size)}


def is_dtensor(t: object) -> bool:
    """True for a DTensor (a parameter FSDP2 sharded)."""
    from torch.distributed.tensor import DTensor  # only where FSDP2 may have sharded: a one-process run never loads it

    return isinstance(t, DTensor)
