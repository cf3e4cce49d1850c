"""A writer process seen from both sides. The trainer's side: ``WriterProcess``, what the forked and
the process writer share (the answer on the connection, a writer that died as a ``Failed`` line, halting
by SIGTERM then SIGKILL). The writer's side: ``become_writer``, after which it is named
``slimtune-ckpt`` and does not outlive its trainer by more than ``reaper.GRACE_S`` and its exit.

How a writer ends with its trainer: the kernel sends it SIGTERM when the trainer dies
(``PR_SET_PDEATHSIG``); Python raises it in the writer's main thread at its next bytecode, and the writer
removes its temporary directory (``atomic_directory``) and exits. A writer inside a long C call, or at
nice 19 on a busy machine, gets there late: the ``Reaper`` (``reaper.py``), a small process of the
trainer's, kills it ``reaper.GRACE_S`` after the trainer's death. Whatever it was writing was a
temporary sibling, never a checkpoint: the lock it held dies with it, and the next run in that directory
waits for live writers, then reclaims the temporary by its free lock
(``CheckpointManager.find_resume_point``, ``atomic.reclaim_leftovers``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from slimtune.checkpoint.background.protocol import Answer, Failed, WriterSetup
from slimtune.checkpoint.background.reaper import END
from slimtune.distributed import raise_on_sigterm

log = logging.getLogger(__name__)

WRITER_NAME = b"slimtune-ckpt"  # the writer's process name (ps, top)
# How long a writer stopped in a save its peer's writer failed has after SIGTERM (removing its temporary
# directory: an rmtree), then after SIGKILL, before the trainers go on without it.
_HALT_S = 30.0
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


class Reaper:
    """The trainer's reaper process (``reaper.py``), started with the writer: ``watch(pid)`` for each
    writer process; ``close()`` when the run's writers are stopped. Where the kernel has no pidfds
    (before Linux 5.3) there is none, and a writer ends by its SIGTERM alone."""

    def __init__(self):
        self.fd: int | None = None
        if not hasattr(os, "pidfd_open"):
            return
        theirs, ours = os.pipe()  # it reads the pids that the trainer writes
        argv = [sys.executable, "-S", str(Path(__file__).with_name("reaper.py")), str(theirs), str(os.getpid())]
        try:  # its own session: a Ctrl-C for the trainer is not for it
            self.proc = subprocess.Popen(argv, pass_fds=[theirs], stdin=subprocess.DEVNULL, start_new_session=True)
            self.fd = ours
        except OSError:
            os.close(ours)
        finally:
            os.close(theirs)

    def watch(self, pid: int) -> None:
        if self.fd is not None:
            try:
                os.write(self.fd, f"{pid}\n".encode())
            except OSError:  # it died (killed by hand): the writer ends by its SIGTERM alone
                self.close()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.fd, END)  # it ends at once
            os.close(self.fd)
            self.fd = None
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class WriterProcess:
    """The trainer's handle on a writer process: its connection, its exit status, its answers."""

    def __init__(self, setup: WriterSetup):
        self.setup = setup
        self.reaper = Reaper()
        self.conn: Connection | None = None
        self.doing = ""  # what the writer does now, for the line if it dies ("writing step-000002")

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    def exit_code(self) -> int | None:
        """The writer's exit status once it ended (negative: the signal that killed it), else None."""
        raise NotImplementedError

    def reap(self) -> int:
        """Wait for the writer to end (it answered, or its connection closed); its exit status."""
        raise NotImplementedError

    def poll(self, timeout: float) -> Answer | None:
        return self.receive(timeout)

    def receive(self, timeout: float) -> object | None:
        """The writer's next message if it comes (or the writer dies) within ``timeout`` s, else None; a
        writer that died is a ``Failed`` line, its own."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self.exit_code() is not None:
                break
            if time.monotonic() >= deadline:
                return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return self.lost()

    def lost(self) -> Failed:
        """The line for a writer that died while ``doing``."""
        code = self.reap()
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        ranks, out = self.setup.ranks, self.setup.manager.out
        whose = f" of rank {ranks.rank}" if ranks.world_size > 1 else ""
        return Failed(f"the checkpoint writer{whose} died ({how}) while {self.doing}; {out} holds the checkpoints before it", own=True)

    def halt(self) -> None:
        """Stop the writer inside a save another rank's writer failed: it may be at its own work (long
        writes, a slow disk) or wait in a collective for the failed one. SIGTERM (it removes its
        temporary directory and answers), SIGKILL after ``_HALT_S`` without an answer (the coordinator
        reclaims what it left); its answer is dropped (the failure is the peer's)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.exit_code() is None:
                os.kill(self.pid, sig)
            deadline = time.monotonic() + _HALT_S
            while time.monotonic() < deadline:
                if self.conn.poll(0.1) or self.exit_code() is not None:
                    return
        log.info(f"checkpoint.async: the checkpoint writer (pid {self.pid}) did not end on SIGKILL within {_HALT_S:.0f} s")


def become_writer(parent: int, threads: int) -> bool:
    """Set up a writer process (module docstring): it ends with its parent (SIGTERM; the reaper ends it
    if that is not enough), is named ``slimtune-ckpt`` and computes on ``threads`` threads. False if the
    parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(WRITER_NAME), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a dead trainer's writer ends at its next read of the closed connection
    if os.getppid() != parent:
        return False  # the trainer died before the prctl above
    raise_on_sigterm("the checkpoint writer was stopped by SIGTERM (its trainer ended)")
    torch.set_num_threads(threads)
    return True
