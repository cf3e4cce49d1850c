"""The process writer (``WriterKind.PROCESS``: a model on a GPU, or under torchrun): a process started
with the run rebuilds the frozen NF4 model from the base files with the trainer's own
``load_qlora_model`` arguments (deterministic: the same bytes), on the CPU, and for each save copies the
snapshot's adapters (from a GPU through pinned host buffers) into it. Where the base files changed since
the run started (size or mtime) a save point falls back to the synchronous save.

Under torchrun every rank starts its own writer, and the writers form a gloo process group of their own
(they are no ranks of the job: they meet at a store the coordinator holds, ``WriterGroup``), with the
job's ranks and world size. Each writer loads the model FSDP2-sharded as its trainer did, so it holds the
same rows; each trainer snapshots its local shards; the writers then run the synchronous cooperative save
among themselves. Joining the writers' group fails after ``_JOIN_TIMEOUT`` (every rank then saves
synchronously).

The writer's side is a free function, ``writer_main`` (``python -c``), which runs ``serve``."""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from slimtune.checkpoint.background.child import WriterProcess, become_writer
from slimtune.checkpoint.background.protocol import Ready, Request, Start, Stop, Unavailable, WriterGroup, WriterSetup, WriterSpec
from slimtune.checkpoint.background.snapshot import tree_to_host, write_request
from slimtune.checkpoint.manager import CheckpointManager
from slimtune.distributed import SINGLE, Ranks, current_ranks, join_group, shutdown
from slimtune.errors import SlimtuneError, first_line
from slimtune.logs import configure_logging
from slimtune.model import load_qlora_model
from slimtune.runtime import usable_cores

_GROUP_TIMEOUT = datetime.timedelta(seconds=1800)  # the writers' collectives, as the trainers' (init_distributed)
# How long a writer waits for the others to join the writers' group. They start together (the trainers
# start them after one collective) and join once Python and torch are imported (~4 s alone, more on a
# busy host): 120 s is a wide margin, and a writer that cannot join costs its peers 120 s, not 1800 s.
_JOIN_TIMEOUT = datetime.timedelta(seconds=120)
_STOP_S = 60  # how long a stopped writer has to end before it is killed


def base_fingerprint(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file of the base directory: a change means the writer's NF4 model may
    no longer be the trainer's."""
    try:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
    except OSError:
        return {}


class ProcessWriter(WriterProcess):
    """The writer process of a run (``Writer`` protocol), started at once; it loads while training begins."""

    yields_cpu = False

    def __init__(self, setup: WriterSetup):
        super().__init__(setup)
        self.fingerprint = base_fingerprint(setup.spec.model_dir)
        self.ready = False
        self.store, group = _writer_group(setup.ranks)  # the writers' own process group, through a store on the coordinator
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        self.start(theirs)
        self.conn.send(Start(dataclasses.replace(setup.spec, group=group), setup.manager.out))

    def start(self, end: socket.socket) -> None:
        """The writer: ``python -c`` running ``writer_main`` on its end of the socket pair."""
        fd = end.detach()
        package_root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)  # the writer is no rank of a job
        code = (  # logging off before the imports: the trainer has said everything importing and loading say (torchao's notes)
            "import logging, sys; logging.disable(logging.WARNING); "
            "from slimtune.checkpoint.background.process import writer_main; writer_main(int(sys.argv[1]), int(sys.argv[2]))"
        )
        try:
            argv = [sys.executable, "-c", code, str(fd), str(os.getpid())]
            self.proc = subprocess.Popen(argv, pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(fd)
        self.reaper.watch(self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def reap(self) -> int:
        return self.proc.wait()

    def unusable(self, step: int) -> str | None:
        """The base files changed since the run started, or the writer could not load (waits for it to be ready)."""
        if base_fingerprint(self.setup.spec.model_dir) != self.fingerprint:
            return f"the base files in {self.setup.spec.model_dir} changed since the run started"
        if not self.ready:
            self.doing = f"starting the checkpoint writer for step-{step:06d}"
            message = self.receive(float("inf"))
            if not isinstance(message, Ready):
                return message.line  # Unavailable, or Failed: it died
            self.ready = True
        return None

    def submit(self, request: Request) -> int:
        """The snapshot's tensors copied to host memory (pinned buffers from a GPU; of a DTensor, this
        rank's shard), serialized and sent; its bytes."""
        self.doing = f"writing {request.name}"
        buffer = io.BytesIO()
        torch.save(dataclasses.replace(request, train_state=tree_to_host(request.train_state)), buffer)
        try:
            self.conn.send_bytes(buffer.getbuffer())
        except OSError:
            pass  # the writer is gone: the next poll says so
        return buffer.getbuffer().nbytes

    def stop(self) -> None:
        if self.conn is None or self.conn.closed:
            return
        try:
            self.conn.send_bytes(_serialized(Stop()))
        except OSError:
            pass
        self.end()
        self.conn.close()
        self.reaper.close()
        self.store = None  # the writers' store (coordinator): their group is gone

    def end(self) -> None:
        """Wait for the stopped writer to end (killed after ``_STOP_S``)."""
        try:
            self.proc.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serialized(message: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _writer_group(ranks: Ranks) -> tuple[object, WriterGroup | None]:
    """Under a process group: a store on the coordinator (a free port) for the writers to meet at, its
    port sent to every rank. Returns (the store, held by the coordinator; this rank's ``WriterGroup``)."""
    if not ranks.distributed:
        return None, None
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = None
    if ranks.is_coordinator:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_GROUP_TIMEOUT)
    port = ranks.broadcast(store.port if store is not None else None, "starting the checkpoint writers")
    return store, WriterGroup(host, port, ranks.rank, ranks.world_size)


def writer_main(fd: int, parent: int) -> None:
    """The writer process: ends with its parent (``child.become_writer``), then serves save requests
    until the trainer stops it or closes the connection."""
    if not become_writer(parent, threads=max(1, usable_cores() // 2)):
        return
    logging.disable(logging.WARNING)  # the trainer has said everything loading says (also set by start's code)
    try:
        serve(Connection(fd), speak=True)
    except (SlimtuneError, KeyboardInterrupt):
        pass


def serve(conn: Connection, speak: bool = False) -> None:
    """Join the writers' group (under a process group), load the model as the trainer did, answer
    ``Ready``, then write each ``Request``'s checkpoint until ``Stop``. ``speak``: a process of its own,
    whose slimtune lines print once it serves (``_speak_after_loading``)."""
    spec = None
    try:
        start = conn.recv()
        spec = start.spec
        try:
            ranks = _join_writers(spec.group)
            model = _load(spec, ranks)
        except Exception as e:  # noqa: BLE001 - the trainers save synchronously instead
            conn.send(Unavailable(str(e)))
            return
        conn.send(Ready())
        params = dict(model.named_parameters())
        manager = CheckpointManager(start.out)
        if speak:
            _speak_after_loading()
        while isinstance(request := torch.load(io.BytesIO(conn.recv_bytes()), map_location="cpu", weights_only=False), Request):
            conn.send(write_request(model, manager, request, ranks, params))
    except EOFError:
        return
    finally:
        conn.close()
        if spec is not None and spec.group is not None:
            shutdown()


def _speak_after_loading() -> None:
    """A writer process is silent while it loads (the trainer has said all that); once it serves, slimtune's
    own lines (a damaged step-N the save moves aside) print as the trainer's do, the libraries' stay quiet."""
    logging.disable(logging.NOTSET)
    logging.getLogger().setLevel(logging.ERROR)
    configure_logging()


def _join_writers(group: WriterGroup | None) -> Ranks:
    """The writer's place among the writers: their own gloo group (alone: ``SINGLE``). Joining fails
    after ``_JOIN_TIMEOUT`` (a writer that never came); the group's collectives then wait ``_GROUP_TIMEOUT``."""
    if group is None:
        return SINGLE
    try:  # every writer checks in at the store first: that wait is bounded, the group's own (init's) is not
        store = dist.TCPStore(group.host, group.port, is_master=False, timeout=_JOIN_TIMEOUT)
        store.set(f"slimtune-writer-{group.rank}", "here")
        store.wait([f"slimtune-writer-{r}" for r in range(group.world_size)], _JOIN_TIMEOUT)
    except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
        first = first_line(e)
        within = f"{_JOIN_TIMEOUT.total_seconds():.0f} s"
        raise SlimtuneError(f"the checkpoint writers did not all join their group within {within} ({first})") from None
    store.set_timeout(_GROUP_TIMEOUT)
    join_group(backend="gloo", store=store, rank=group.rank, world_size=group.world_size, timeout=_GROUP_TIMEOUT)
    return current_ranks()


def _load(spec: WriterSpec, ranks: Ranks) -> nn.Module:
    """The trainer's model, frozen weights and all (this rank's shards of them under a process group);
    any writer's failure fails every writer (one line)."""
    before = base_fingerprint(spec.model_dir)
    model, error = None, None
    try:
        model = load_qlora_model(spec.model_dir, spec.lora, seed=spec.seed, progress=False, ranks=ranks, dtype=spec.dtype)
        if base_fingerprint(spec.model_dir) != before:
            error = SlimtuneError(f"the base files in {spec.model_dir} changed while the checkpoint writer loaded them")
    except Exception as e:  # noqa: BLE001 - one line for the trainer
        error = SlimtuneError(f"the checkpoint writer cannot load {spec.model_dir} ({type(e).__name__}: {e})")
    ranks.agree(error, "loading the checkpoint writers' model")
    return model
