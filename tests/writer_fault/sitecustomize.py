"""Test-only fault injection in the background checkpoint writer (tests put this directory on PYTHONPATH).
In a process whose command line runs ``slimtune.checkpoint.background`` (the writer, not the trainer),
``SLIMTUNE_WRITER_FAULT=KIND:SECONDS:PATTERN`` acts at each ``os.fsync`` of a path matching PATTERN:
``stall`` writes the writer's pid to ``SLIMTUNE_WRITER_MARKER`` and sleeps SECONDS (the test kills
someone meanwhile); ``enospc`` raises ENOSPC, as a full disk does. Product code knows nothing of it."""

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
            with open(os.environ["SLIMTUNE_WRITER_MARKER"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(float(_seconds))
        return _fsync(fd)

    os.fsync = _faulty_fsync
