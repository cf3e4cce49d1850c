"""The ``slimtune`` logger, which every module logs under (``logging.getLogger(__name__)``), and the one
way slimtune's programs print it (``configure_logging``: the CLI at start, a checkpoint writer process
once it has loaded). The library itself adds no handler: an application that imports slimtune chooses.

What a run says (the recipe's progress lines, the run directory's notes, a background save's figures)
goes through it at INFO; warnings at WARNING; notes for a closer look at DEBUG (``SLIMTUNE_DEBUG=1``).
A command's own answer (generated text, verify's report, an error line) is the CLI's ``print``.

Example::

    configure_logging()
    logging.getLogger("slimtune.recipes.finetune").info("printed as the CLI prints it")
"""

from __future__ import annotations

import logging
import os
import sys


class _ProgressSafeHandler(logging.Handler):
    """The bare message as plain text that does not tear a tqdm progress bar (``tqdm.write``): INFO and
    below on stdout, warnings and errors on stderr (where Python's last-resort handler put them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # lazy: `slimtune --help` does not need it

            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr  # looked up now: redirected streams work
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a handler that fails
            self.handleError(record)


def _coordinator_speaks(record: logging.LogRecord) -> bool:
    """Under torchrun only rank 0 says what the job does (every rank does the same); warnings and errors
    come from every rank that has them."""
    if record.levelno >= logging.WARNING:
        return True
    dist = sys.modules.get("torch.distributed")  # imported by then wherever a process group can be up
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def configure_logging(level: int | None = None) -> None:
    """Print the ``slimtune`` logger: the bare message, INFO by default (DEBUG with SLIMTUNE_DEBUG=1), on
    stdout through the progress bar (warnings on stderr), rank 0 only under torchrun. Calling it again
    changes only the level (one handler).

    Example: ``configure_logging(); run_finetune(cfg)`` prints the recipe's lines as ``slimtune finetune`` does"""
    logger = logging.getLogger("slimtune")
    if not any(isinstance(h, _ProgressSafeHandler) for h in logger.handlers):
        handler = _ProgressSafeHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_coordinator_speaks)
        logger.addHandler(handler)
    if level is None:
        level = logging.DEBUG if os.environ.get("SLIMTUNE_DEBUG") == "1" else logging.INFO
    logger.setLevel(level)
