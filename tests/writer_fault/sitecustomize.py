"""Test-only fault injection in the background checkpoint writer (tests put this directory on PYTHONPATH).
In a process whose command line runs ``slimtune.checkpoint.background`` (the writer, not the trainer),
``SLIMTUNE_WRITER_FAULT=KIND:SECONDS:PATTERN`` acts at each ``os.fsync`` of a path matching PATTERN:
``stall`` writes the writer's pid to ``SLIMTUNE_WRITER_MARKER`` and sleeps SECONDS (the test kills
someone meanwhile); ``hold`` writes the pid likewise and waits until the file MARKER.release exists (at
most SECONDS); ``enospc`` raises ENOSPC, as a full disk does. With ``hold`` the trainer's side takes part
too: once the writer is held, the trainer's first blocking wait for a message from the writer (a save
point reached while that save is in flight) creates MARKER.trainer-waiting, so the test knows when to
release. Product code knows nothing of it."""

import errno
import os
import re
import time

_FAULT = os.environ.get("SLIMTUNE_WRITER_FAULT")
with open("/proc/self/cmdline", "rb") as _f:
    _WRITER = b"slimtune.checkpoint.background" in _f.read()

if _FAULT and _WRITER:
    _kind, _seconds, _pattern = _FAULT.split(":", 2)
    _fsync = os.fsync

    def _faulty_fsync(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if re.search(_pattern, target):
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

elif _FAULT and _FAULT.startswith("hold:"):  # the trainer: the saver waits on its Connection with a timeout
    from multiprocessing.connection import Connection

    _poll = Connection.poll
    _marker = os.environ["SLIMTUNE_WRITER_MARKER"]

    def _noting_poll(self, timeout=0.0):
        if timeout and os.path.exists(_marker) and not os.path.exists(_marker + ".trainer-waiting"):
            with open(_marker + ".trainer-waiting", "w") as f:
                f.write(str(time.monotonic()))
        return _poll(self, timeout)

    Connection.poll = _noting_poll
