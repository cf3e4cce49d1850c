"""What the trainer and a background writer say to each other, as small message classes (torchtitan's
``SaveDone`` / ``Terminate``), what a writer is made from, and the one ``Writer`` protocol that every
writer implements (``saver.BackgroundSaver`` drives it; ``forked.ForkedWriter`` and
``process.ProcessWriter`` are the product's two, chosen once by ``WriterKind``).

The exchange: a process writer gets ``Start`` and answers ``Ready`` (or ``Unavailable``: the trainers
then save synchronously); each save is one ``Request`` answered by ``Done`` or ``Failed``; ``Stop`` ends
it. A forked writer is forked with its one ``Request`` in memory and answers once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from slimtune.distributed import Ranks

if TYPE_CHECKING:
    from torch import nn

    from slimtune.checkpoint.manager import CheckpointManager
    from slimtune.checkpoint.save import SaveOptions
    from slimtune.lora import LoRAConfig


class WriterKind(enum.Enum):
    """How a run's background saves are written (``saver.choose_kind`` picks one per run)."""

    FORK = "fork"  # a writer forked at each save point: its memory, copy-on-write, is the snapshot
    PROCESS = "process"  # a writer process started with the run, which rebuilt the frozen model


@dataclass(frozen=True)
class WriterGroup:
    """Where the writer of a job's rank joins the writers' own gloo process group: the address and port
    of the store the coordinator holds, its rank (the trainer's) and the world size (the job's)."""

    host: str
    port: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class WriterSpec:
    """What the writer rebuilds the frozen model from: the trainer's ``load_qlora_model`` arguments, and
    under a process group the writers' own group (``WriterGroup``, filled in by ``ProcessWriter``)."""

    model_dir: Path
    lora: LoRAConfig
    seed: int = 0
    dtype: torch.dtype | None = None
    group: WriterGroup | None = None


@dataclass(frozen=True)
class WriterSetup:
    """Everything a writer is made from: the spec, the run directory's manager, the ranks, the trainer's
    model (what a forked writer shares). Writers log under their module's logger."""

    spec: WriterSpec
    manager: CheckpointManager
    ranks: Ranks
    model: nn.Module | None


# --- the trainer's messages ---


@dataclass(frozen=True)
class Start:
    """To a process writer, once: load the model of ``spec`` and write the checkpoints of ``out``."""

    spec: WriterSpec
    out: Path


@dataclass(frozen=True)
class Request:
    """One save: the step, the recipe state, the save options (without their files), the small files'
    bytes (read at the save point), the training state (a forked writer's: the trainer's own tensors; a
    process writer's: host copies, a DTensor as ``snapshot.Shard``) and the forked writer's nice value."""

    step: int
    state: dict
    options: SaveOptions
    extra: dict[str, bytes]
    train_state: dict
    nice: int

    @property
    def name(self) -> str:
        return f"step-{self.step:06d}"


@dataclass(frozen=True)
class Stop:
    """To a process writer: no more saves; end."""


# --- the writer's answers ---


@dataclass(frozen=True)
class Ready:
    """A process writer loaded the model: saves can go to it."""


@dataclass(frozen=True)
class Unavailable:
    """A process writer could not load the model or join its group (``line``): every save is synchronous."""

    line: str


@dataclass(frozen=True)
class Done:
    """A save is complete: its seconds in the background, its bytes, the writer's peak RSS and the memory
    that was the writer's own (not shared with the trainer) at its end, in MB."""

    seconds: float
    nbytes: int
    peak_rss_mb: float
    private_mb: float


@dataclass(frozen=True)
class Failed:
    """A save failed (one line). ``own``: the cause is this writer's (a full disk, its death), not a
    peer's that this writer learnt of in a collective."""

    line: str
    own: bool


Answer = Done | Failed


class Writer(Protocol):
    """One run's background writer as ``BackgroundSaver`` drives it: at most one ``Request`` in flight."""

    yields_cpu: bool  # it runs at the request's nice value (the forked writer); else at the trainer's

    @property
    def pid(self) -> int | None:
        """The process writing now (or last), for ps and for tests."""

    def unusable(self, step: int) -> str | None:
        """Why the save at ``step`` cannot go to this writer (waits for it to be ready), or None."""

    def submit(self, request: Request) -> int:
        """Hand over one save's snapshot; returns its bytes. A writer lost on the way answers ``Failed``."""

    def poll(self, timeout: float) -> Answer | None:
        """The answer to the request in flight if it comes within ``timeout`` s (a writer that died:
        ``Failed``, its own), else None."""

    def halt(self) -> None:
        """Stop the save in flight (a peer's failed): by a signal, the answer dropped."""

    def stop(self) -> None:
        """No more saves: end the writer (idempotent)."""
