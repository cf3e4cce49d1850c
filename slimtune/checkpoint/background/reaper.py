"""The reaper: a small process (the standard library only, run as a script) that bounds how long a
run's background writers outlive their trainer.

A writer learns of its trainer's death from the kernel (``PR_SET_PDEATHSIG``: SIGTERM, on which it
removes its temporary directory and exits), but only at its next Python bytecode: inside a long C call
it cannot act, and a forked writer at nice 19 on a busy machine gets the CPU (and with it the GIL, which
even a watchdog thread of its own would need) seldom. The reaper does not depend on the writer: the
trainer starts it with the run (``Reaper``) and tells it the pid of each writer; when the trainer dies
it gives those writers their trainer's priority back where permitted (CAP_SYS_NICE or RLIMIT_NICE),
``GRACE_S`` to end by their SIGTERM, then SIGKILLs them and has the kernel release their memory in its
own time slice (``process_mrelease``, Linux 5.15: a nice-19 process would free it slowly). Then it exits;
it also exits when the trainer closes its end (the run is over). A writer it killed leaves at most a
temporary directory whose lock died with it: the next run in that directory reclaims it.

Usage (by ``Reaper``): ``python reaper.py FD`` with FD the read end of a pipe that carries writer pids,
one a line.
"""

import ctypes
import os
import select
import signal
import sys
import time

END = b"end\n"  # the trainer's last word: its writers are stopped
GRACE_S = 2.0  # how long a writer whose trainer died has to end by its SIGTERM before it is killed
_PROCESS_MRELEASE = 448  # the syscall's number (the generic table: x86_64 and arm64 alike)


def watch_trainer(fd: int, trainer: int) -> None:
    """Watch ``trainer`` and the writers whose pids arrive on ``fd``; end them when the trainer dies
    (its pidfd is readable, or its end of the pipe closed without ``END``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: the reaper still has its job
    try:
        watched = os.pidfd_open(trainer)
    except OSError:
        watched = None  # gone before the reaper started: what it said is in the pipe
    writers: dict[int, int] = {}  # pid -> pidfd
    os.set_blocking(fd, False)
    pending = b""
    while watched is not None:
        ready, _, _ = select.select([fd, watched], [], [])
        data = _read(fd) if fd in ready else b""
        if data.endswith(END):
            return  # the run is over: its writers are stopped
        pending = _add(writers, pending + data)
        if watched in ready or (fd in ready and not data):
            break  # the trainer died (or closed its end without a word: the same)
    _add(writers, pending + _read(fd))
    _end(writers, os.getpriority(os.PRIO_PROCESS, 0))


def _read(fd: int) -> bytes:
    """What is in the pipe now (b"" at its end)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _add(writers: dict[int, int], data: bytes) -> bytes:
    """The pids in ``data``'s whole lines opened as pidfds; returns the rest."""
    *lines, rest = data.split(b"\n")
    for line in lines:
        try:
            writers[int(line)] = os.pidfd_open(int(line))
        except (ValueError, OSError):
            pass  # already gone
    return rest


def _end(writers: dict[int, int], nice: int) -> None:
    alive = {pid: pidfd for pid, pidfd in writers.items() if not _exited(pidfd, 0.0)}
    for pid in alive:
        _renice(pid, nice)
    deadline = time.monotonic() + GRACE_S
    for pidfd in alive.values():
        if _exited(pidfd, max(0.0, deadline - time.monotonic())):
            continue
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            continue
        ctypes.CDLL(None, use_errno=True).syscall(_PROCESS_MRELEASE, pidfd, 0)  # fails harmlessly where unknown


def _exited(pidfd: int, timeout: float) -> bool:
    return bool(select.select([pidfd], [], [], timeout)[0])


def _renice(pid: int, nice: int) -> None:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass  # not permitted (or gone): it ends at its own priority


if __name__ == "__main__":
    watch_trainer(int(sys.argv[1]), int(sys.argv[2]))
