"""The train-save bench's ``thread`` mode: the process writer's ``serve`` on a thread of the trainer's
process instead of a process of its own (the GIL shared with training), for the comparison of writers
only; slimtune itself writes through a forked writer or a writer process (slimtune/checkpoint/background).

Run as the CLI is, with that writer (``python -m bench train-save`` does, for its ``thread`` mode)::

    python bench/thread_writer.py finetune --config tiny output_dir=out
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from multiprocessing.connection import Connection

from slimtune.checkpoint.background import custom_writer
from slimtune.checkpoint.background.process import ProcessWriter, serve


class ThreadWriter(ProcessWriter):
    """``ProcessWriter`` with ``serve`` on a daemon thread (``Writer`` protocol): one process, no peer to fail."""

    def start(self, end: socket.socket) -> None:
        self.thread = threading.Thread(target=serve, args=(Connection(end.detach()),), name="slimtune-ckpt", daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def exit_code(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def reap(self) -> int:
        self.thread.join()
        return 0

    def halt(self) -> None:
        self.receive(math.inf)  # a thread cannot be signalled: its answer, whatever it is

    def end(self) -> None:
        self.thread.join()


def main(argv: list[str]) -> int:
    from slimtune.cli import main as cli_main

    with custom_writer(ThreadWriter):
        return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
