"""The forked writer (``WriterKind.FORK``: a model in host memory, one process, Linux): at each save
point the trainer forks a writer whose memory is the trainer's at that instant, copy-on-write. The
frozen NF4 model, the adapters and the training state's tensors are the snapshot: nothing is copied or
rebuilt. It runs the synchronous save itself on one thread (GNU OpenMP's thread pool does not survive a
fork: a forked process that computes on several threads hangs) at the request's nice value, answers
once and exits. What it holds beyond the trainer's pages is its chunks plus the pages the trainer
rewrites while it runs (``Done.private_mb``). A fork that fails (no memory or processes left) has the
trainer write that save itself, with one log line."""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from multiprocessing.connection import Connection

from slimtune.checkpoint.background.child import WriterProcess, become_writer
from slimtune.checkpoint.background.protocol import Answer, Request, WriterSetup
from slimtune.checkpoint.background.snapshot import write_request
from slimtune.distributed import SINGLE

log = logging.getLogger(__name__)


class ForkedWriter(WriterProcess):
    """A writer forked for each request (``Writer`` protocol)."""

    yields_cpu = True

    def __init__(self, setup: WriterSetup):
        super().__init__(setup)
        self.child: int | None = None
        self.status: int | None = None  # the last child's exit status
        self.answered: Answer | None = None  # a save the trainer wrote itself (the fork failed)

    @property
    def pid(self) -> int | None:
        return self.child

    def unusable(self, step: int) -> str | None:
        return None  # it shares the trainer's model: no base file is read, nothing to wait for

    def submit(self, request: Request) -> int:
        """Fork the writer of ``request`` (its memory is the trainer's at this instant: the model, the
        training state's tensors, copy-on-write, nothing copied now). The bytes handed over: the small
        files'."""
        self.doing = f"writing {request.name}"
        try:
            self.child, self.conn = _fork(self.setup, request, self.reaper.fd)
        except OSError as e:  # no memory or processes left for a fork: this save in the trainer, as a synchronous one
            log.info(f"checkpoint.async: cannot fork the checkpoint writer ({e.strerror}); saving {request.name} in the trainer")
            self.answered = write_request(self.setup.model, self.setup.manager, request, SINGLE, own_process=False)
        else:
            self.status = None
            self.reaper.watch(self.child)
        return sum(len(data) for data in request.extra.values())

    def poll(self, timeout: float) -> Answer | None:
        if self.answered is not None:
            answer, self.answered = self.answered, None
            return answer
        answer = self.receive(timeout)
        if answer is not None:  # its one save answered (or it died): it exits
            self.reap()
            self.conn.close()
        return answer

    def exit_code(self) -> int | None:
        if self.status is None and self.child is not None:
            pid, status = os.waitpid(self.child, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def reap(self) -> int:
        if self.status is None:
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.child, 0)[1])
        return self.status

    def stop(self) -> None:
        self.reaper.close()  # each writer ends after its one answer; the saver has taken it (or halted the writer)


def _fork(setup: WriterSetup, request: Request, reaper: int | None) -> tuple[int, Connection]:
    ours, theirs = socket.socketpair()
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered before the fork is written twice
        stream.flush()
    pid = os.fork()
    if pid == 0:
        ours.close()
        if reaper is not None:
            os.close(reaper)  # the trainer's end of the pipe to its reaper
        _forked_main(Connection(theirs.detach()), setup, request, parent)
    theirs.close()
    return pid, Connection(ours.detach())


def _forked_main(conn: Connection, setup: WriterSetup, request: Request, parent: int) -> None:
    """The forked writer: never returns into the trainer's code (``os._exit``)."""
    code = 1
    try:
        gc.disable()  # the trainer's objects are the snapshot: no finalizer of theirs runs here
        if become_writer(parent, threads=1):  # GNU OpenMP's pool does not survive a fork: more threads hang
            os.nice(request.nice)
            conn.send(write_request(setup.model, setup.manager, request, SINGLE))
            code = 0
    except BaseException:  # noqa: BLE001 - a lost writer is the trainer's one line (WriterProcess.lost)
        pass
    finally:
        os._exit(code)
