"""Zero-stall checkpoints (``checkpoint.async``): at a save point the training loop only snapshots what
changes (adapters, optimizer, scheduler, loss scaler, RNG, data position: ``train_state``, the recipe
state and the small documents) and hands it to a writer process, which writes the whole checkpoint
through the one writer (``CheckpointManager.save`` -> ``write_checkpoint``) while training goes on.

The writer is a process of its own, started with the run: it rebuilds the frozen NF4 model from the
base files with the trainer's own ``load_qlora_model`` arguments (deterministic: the same bytes), on
the CPU, and for each save copies the snapshot's adapters into it. So an asynchronous checkpoint is the
synchronous one, byte for byte (tested), and the trainer's memory grows only by the snapshot. The
comparison behind the choice (a thread instead of a process: the same code in the trainer's process)
is in docs/benchmarks.md; ``SLIMTUNE_ASYNC_WRITER=thread`` selects it, for that measurement only.

Rules: at most one save in flight (a save point reached while the previous save runs waits for it,
and the wait is stall); the run's end waits for the last save; ``keep_last_n`` prunes after a save is
complete. A failure in the writer (a full disk, a read-only file system, a killed writer) is raised
as one ``SlimtuneError`` line at the trainer's next step, after the writer's temporary directory is
gone. The writer dies with the trainer (``PR_SET_PDEATHSIG``: SIGTERM, on which it removes its
temporary directory); a temporary directory left anyway is reclaimed by its lock (``atomic.py``).
Where the base files changed since the run started (size or mtime) a save point falls back to the
synchronous save, with one log line.

Example::

    saver = BackgroundSaver(WriterSpec(model_dir, lora, seed=0, dtype=torch.bfloat16), manager, say)
    if saver.available(step):
        stall_s = saver.submit(step, state, options, train_state)   # returns once the snapshot is sent
    saver.annotate(record)        # every step: in-flight flag, a finished save's figures; raises a failure
    saver.close()                 # waits for the last save
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from slimtune.checkpoint.manager import CheckpointManager
from slimtune.checkpoint.save import SaveOptions
from slimtune.distributed import raise_on_sigterm
from slimtune.errors import SlimtuneError
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss
from slimtune.model import load_qlora_model
from slimtune.runtime import usable_cores

MECHANISM_ENV = "SLIMTUNE_ASYNC_WRITER"  # "process" (the default) or "thread": for the measurement only
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WriterSpec:
    """What the writer rebuilds the frozen model from: the trainer's ``load_qlora_model`` arguments."""

    model_dir: Path
    lora: LoRAConfig
    seed: int = 0
    dtype: torch.dtype | None = None


def base_fingerprint(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file of the base directory: a change means the writer's NF4 model may
    no longer be the trainer's."""
    try:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
    except OSError:
        return {}


@dataclass
class _InFlight:
    step: int
    name: str
    started: float
    step_rates: list[float] = dataclasses.field(default_factory=list)


class BackgroundSaver:
    """The trainer's side of the writer (module docstring). One per run, on one process."""

    def __init__(self, spec: WriterSpec, manager: CheckpointManager, log: Callable[[str], None], mechanism: str | None = None):
        self.spec, self.manager, self.log = spec, manager, log
        self.fingerprint = base_fingerprint(spec.model_dir)
        self.mechanism = mechanism or os.environ.get(MECHANISM_ENV, "process")
        self.in_flight: _InFlight | None = None
        self.unusable: str | None = None  # why saves are synchronous from now on
        self.ready = False
        self.finished: list[tuple[_InFlight, dict]] = []  # saves finished since the last annotate
        self.outside_rates: list[float] = []  # tokens/s of the steps that ran during no save
        self.busy: _InFlight | None = None  # the save in flight when the current step began
        self.said = False
        self.snapshot_bytes: int | None = None
        self.ready_wait_s = 0.0
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        if self.mechanism == "thread":
            self.thread = threading.Thread(target=_serve, args=(Connection(theirs.detach()),), name="slimtune-ckpt", daemon=True)
            self.thread.start()
        else:
            self.proc = _start_process(theirs)
        self.conn.send((spec, manager.out))

    # --- the save point ---------------------------------------------------------------------------

    def available(self, step: int) -> bool:
        """Whether the save at ``step`` can go to the writer: it loaded the same base (waits for it to be
        ready: that wait is stall), and the base files are unchanged since the run started. The first
        time not, one log line; from then on every save is synchronous."""
        if self.unusable is None and base_fingerprint(self.spec.model_dir) != self.fingerprint:
            self.unusable = f"the base files in {self.spec.model_dir} changed since the run started"
        if self.unusable is None and not self.ready:
            started = time.perf_counter()
            message = self._receive(f"starting the checkpoint writer for step-{step:06d}")
            self.ready_wait_s = time.perf_counter() - started  # stall too: submit adds it
            if message[0] == "ready":
                self.ready = True
            else:
                self.unusable = message[1]
        if self.unusable is not None and not self.said:
            self.log(f"checkpoint.async: {self.unusable}; saving synchronously from step {step} on")
            self.said = True
            self._stop_writer()
        return self.unusable is None

    def submit(self, step: int, state: dict, options: SaveOptions, train_state: dict) -> float:
        """Wait for the save in flight (if any), snapshot ``train_state`` (its tensors copied to host
        memory: pinned buffers from a GPU), the recipe state and the small files of ``options``, and hand
        them to the writer. Returns the seconds the caller was blocked (with any wait for the writer to
        be ready in ``available``)."""
        started = time.perf_counter() - self.ready_wait_s
        self.ready_wait_s = 0.0
        if self.in_flight is not None:
            self._wait()
        extra = {name: Path(path).read_bytes() for name, path in (options.extra_files or {}).items()}
        request = {"step": step, "state": state, "options": dataclasses.replace(options, extra_files=None), "extra": extra}
        request["train_state"] = _to_host(train_state)
        buffer = io.BytesIO()
        torch.save(request, buffer)
        del request
        self.snapshot_bytes = buffer.getbuffer().nbytes
        try:
            self.conn.send_bytes(buffer.getbuffer())
        except OSError:
            self._writer_lost(step)
        self.in_flight = _InFlight(step, self.manager.step_path(step).name, time.perf_counter())
        return time.perf_counter() - started

    # --- every step ---------------------------------------------------------------------------------

    def annotate(self, record: dict, last: bool = False) -> None:
        """Fill a step's metrics record: ``checkpoint_in_flight`` (a save ran during the step), and for a
        save that finished, ``checkpoint_saved``, ``checkpoint_save_s`` (its background duration),
        ``checkpoint_bytes``, ``checkpoint_peak_rss_mb`` (the writer's), ``checkpoint_snapshot_bytes`` (on
        the save point's step), ``tokens_per_s_during_save`` and
        ``tokens_per_s_outside_save`` (mean throughput of the steps that ran during it, and of the steps
        so far that ran during no save). ``last``: the run ends here; wait for the save in flight
        (``checkpoint_final_wait_s``); where two saves finish in one step, the earlier one's figures go
        to ``checkpoint_also_saved``. Raises the writer's failure as one line."""
        busy = self.busy  # the save in flight when this step began
        if record.get("tokens_per_s") is not None:
            (busy.step_rates if busy is not None else self.outside_rates).append(record["tokens_per_s"])
        if self.in_flight is not None and self.conn.poll():
            self._finish(self._receive(f"writing {self.in_flight.name}"))
        if last and self.in_flight is not None:
            started = time.perf_counter()
            self._wait()
            record["checkpoint_final_wait_s"] = time.perf_counter() - started
        record["checkpoint_in_flight"] = busy is not None
        if self.snapshot_bytes is not None:  # this step's save point: the serialized snapshot's size
            record["checkpoint_snapshot_bytes"], self.snapshot_bytes = self.snapshot_bytes, None
        for flight, figures in self.finished:
            if flight.step_rates:
                figures["tokens_per_s_during_save"] = sum(flight.step_rates) / len(flight.step_rates)
            if self.outside_rates:
                figures["tokens_per_s_outside_save"] = sum(self.outside_rates) / len(self.outside_rates)
            if "checkpoint_saved" in record:  # two finished in one step (the last one waited for the one before)
                record.setdefault("checkpoint_also_saved", []).append({k: record[k] for k in figures if k in record})
            record.update(figures)
        self.finished = []
        self.busy = self.in_flight

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer."""
        if self.in_flight is not None:
            self._wait()
        if not self.said:
            self._stop_writer()

    # --- internals ----------------------------------------------------------------------------------

    def _wait(self) -> None:
        self._finish(self._receive(f"writing {self.in_flight.name}"))

    def _finish(self, message: tuple) -> None:
        flight, self.in_flight = self.in_flight, None
        if message[0] != "done":
            self._reclaim()
            raise SlimtuneError(message[1])
        _, seconds, nbytes, writer_peak = message
        removed = self.manager.prune()
        figures = {"checkpoint_saved": flight.name, "checkpoint_save_s": seconds, "checkpoint_bytes": nbytes}
        figures["checkpoint_peak_rss_mb"] = writer_peak
        self.finished.append((flight, figures))
        self.log(
            f"saved {flight.name} in the background ({nbytes:,} bytes, {seconds:.2f} s, writer peak RSS {writer_peak:.0f} MB)"
            + (f"; removed {', '.join(removed)}" if removed else "")
        )

    def _receive(self, what: str) -> tuple:
        """The writer's next message; a writer that died is one line (its temporary directory reclaimed)."""
        while not self.conn.poll(0.2):
            if not self._writer_alive():
                break
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self._writer_lost(None, what)

    def _writer_alive(self) -> bool:
        return self.thread.is_alive() if self.thread is not None else self.proc.poll() is None

    def _writer_lost(self, step: int | None, what: str | None = None) -> None:
        what = what or f"writing step-{step:06d}"
        if self.proc is not None:
            self.proc.wait()
            code = self.proc.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        else:
            how = "its thread ended"
        self.in_flight = None
        self._reclaim()  # its temporary directory: the lock died with it
        raise SlimtuneError(f"the checkpoint writer died ({how}) while {what}; {self.manager.out} holds the checkpoints before it")

    def _reclaim(self) -> None:
        if self.manager.out.is_dir():
            self.manager.remove_leftovers()

    def _stop_writer(self) -> None:
        if self.conn.closed:
            return
        try:
            self.conn.send_bytes(b"")
        except OSError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.thread is not None:
            self.thread.join()
        self.conn.close()


def _to_host(tree: object) -> object:
    """The tensors of ``tree`` copied off a GPU into pinned host buffers (asynchronously, then one
    synchronisation); CPU tensors as they are (serialising copies them)."""
    copies = []

    def walk(x: object) -> object:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if type(x) is not torch.Tensor:
                raise SlimtuneError(f"checkpoint.async: a {type(x).__name__} in the training state (background saves are for one process)")
            if x.is_cuda:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x, non_blocking=True)
                copies.append(x.device)
                return host
            return x
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    out = walk(tree)
    for device in set(copies):
        torch.cuda.synchronize(device)
    return out


def _start_process(end: socket.socket) -> subprocess.Popen:
    """The writer: ``python -c`` running ``writer_main`` on its end of the socket pair."""
    fd = end.detach()
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # the writer is no rank of a job
    code = "import sys; from slimtune.checkpoint.background import writer_main; writer_main(int(sys.argv[1]), int(sys.argv[2]))"
    try:
        return subprocess.Popen([sys.executable, "-c", code, str(fd), str(os.getpid())], pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)
    finally:
        os.close(fd)


def writer_main(fd: int, parent: int) -> None:
    """The writer process: dies with its parent (SIGTERM, which removes its temporary directory),
    then serves save requests until the trainer closes the connection."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a dead trainer's writer ends at its next read of the closed connection
    if os.getppid() != parent:
        return  # the trainer died before the line above
    raise_on_sigterm("the checkpoint writer was stopped by SIGTERM (its trainer ended)")
    logging.disable(logging.WARNING)  # the trainer has said everything loading says
    torch.set_num_threads(max(1, usable_cores() // 2))
    try:
        _serve(Connection(fd))
    except (SlimtuneError, KeyboardInterrupt):
        pass


def _serve(conn: Connection) -> None:
    """Load the model as the trainer did, say ready, then write each request's checkpoint."""
    try:
        spec, out = conn.recv()
        before = base_fingerprint(spec.model_dir)
        try:
            model = load_qlora_model(spec.model_dir, spec.lora, seed=spec.seed, progress=False, dtype=spec.dtype)
        except Exception as e:  # noqa: BLE001 - the trainer saves synchronously instead
            conn.send(("failed", f"the checkpoint writer cannot load {spec.model_dir} ({type(e).__name__}: {e})"))
            return
        if base_fingerprint(spec.model_dir) != before:
            conn.send(("failed", f"the base files in {spec.model_dir} changed while the checkpoint writer loaded them"))
            return
        conn.send(("ready",))
        params = dict(model.named_parameters())
        manager = CheckpointManager(out, log=lambda message: print(message, flush=True))
        while data := conn.recv_bytes():
            conn.send(_write(model, params, manager, torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)))
    except EOFError:
        return
    finally:
        conn.close()


def _write(model: torch.nn.Module, params: dict, manager: CheckpointManager, request: dict) -> tuple:
    """One checkpoint from one snapshot: ("done", seconds, bytes, peak RSS MB) or ("error", one line)."""
    started = time.perf_counter()
    reset_peak_rss()
    try:
        with torch.no_grad():
            for name, value in request["train_state"]["adapter"].items():
                params[name].copy_(value)
        with tempfile.TemporaryDirectory(prefix="slimtune-async-") as tmp:
            extra = {}
            for i, (name, data) in enumerate(request["extra"].items()):
                extra[name] = Path(tmp) / f"{i}-{Path(name).name}"
                extra[name].write_bytes(data)
            options = dataclasses.replace(request["options"], extra_files=extra)
            result = manager.save(model, request["step"], request["state"], options, request["train_state"])
    except SlimtuneError as e:
        return ("error", str(e))
    except Exception as e:  # noqa: BLE001 - one line for the trainer
        return ("error", f"the checkpoint writer failed writing step-{request['step']:06d}: {type(e).__name__}: {e}")
    return ("done", time.perf_counter() - started, result.total_bytes, peak_rss_mb())
