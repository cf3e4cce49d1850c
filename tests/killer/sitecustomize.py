"""Test-only fault injection for multi-process runs (this directory is put on PYTHONPATH by the test):
the rank named by SLIMTUNE_KILL_RANK SIGKILLs itself at its SLIMTUNE_KILL_AT-th os.pwrite, i.e. in the
middle of writing its rows of a checkpoint. Product code knows nothing of it."""

import os
import signal

if os.environ.get("SLIMTUNE_KILL_RANK") == os.environ.get("RANK", "-"):
    _pwrite, _at, _calls = os.pwrite, int(os.environ.get("SLIMTUNE_KILL_AT", "1")), [0]

    def _killing_pwrite(fd, data, offset):
        _calls[0] += 1
        if _calls[0] >= _at:
            os.kill(os.getpid(), signal.SIGKILL)
        return _pwrite(fd, data, offset)

    os.pwrite = _killing_pwrite
