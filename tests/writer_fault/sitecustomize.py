"""Test-only fault injection in the background checkpoint writer (tests put this directory on PYTHONPATH).
In the writer (a process named ``slimtune-ckpt``: forked from the trainer, or the process that rebuilds
the model), ``SLIMTUNE_WRITER_FAULT=KIND:SECONDS:PATTERN`` acts at each ``os.fsync`` of a path matching
PATTERN: ``stall`` writes the writer's pid to ``SLIMTUNE_WRITER_MARKER`` and sleeps SECONDS (the test
kills someone meanwhile); ``hold`` writes the pid likewise and waits until the file MARKER.release exists
(at most SECONDS); ``enospc`` raises ENOSPC, as a full disk does. With ``hold`` the trainer's side takes
part too: once the writer is held, the trainer's first blocking wait for a message from the writer (a
save point reached while that save is in flight) creates MARKER.trainer-waiting, so the test knows when
to release. Both hooks are installed in every process (a forked writer inherits the trainer's) and act
by the process's name at the time of the call. Product code knows nothing of it."""

import errno
import os
import re
import time

_FAULT = os.environ.get("SLIMTUNE_WRITER_FAULT")


def _in_writer() -> bool:
    with open("/proc/self/comm", "rb") as f:
        return f.read().strip() == b"slimtune-ckpt"


if _FAULT:
    _kind, _seconds, _pattern = _FAULT.split(":", 2)
    _fsync = os.fsync

    def _faulty_fsync(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if _in_writer() and re.search(_pattern, target):
            if _kind == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)
            marker = os.environ["SLIMTUNE_WRITER_MARKER"]
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            if _kind == "hold":
                deadline = time.monotonic() + float(_seconds)
                while not os.path.exists(marker + ".release") and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                time.sleep(float(_seconds))
        return _fsync(fd)

    os.fsync = _faulty_fsync

if _FAULT and _FAULT.startswith("hold:"):  # the trainer: the saver waits on its Connection with a timeout
    from multiprocessing.connection import Connection

    _poll = Connection.poll
    _marker = os.environ["SLIMTUNE_WRITER_MARKER"]

    def _noting_poll(self, timeout=0.0):
        if timeout and not _in_writer() and os.path.exists(_marker) and not os.path.exists(_marker + ".trainer-waiting"):
            with open(_marker + ".trainer-waiting", "w") as f:
                f.write(str(time.monotonic()))
        return _poll(self, timeout)

    Connection.poll = _noting_poll
