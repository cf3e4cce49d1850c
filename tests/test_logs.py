"""logs.py: the ``slimtune`` logger as slimtune's programs print it (bare lines, INFO on stdout, warnings on
stderr, rank 0 only for INFO under torchrun, one handler however often it is configured)."""

from __future__ import annotations

import logging

from slimtune.logs import configure_logging


def test_bare_lines_info_on_stdout_warnings_on_stderr_rank_0_speaks(capsys, monkeypatch):
    logger = logging.getLogger("slimtune")
    before = (list(logger.handlers), logger.level)
    try:
        configure_logging()
        configure_logging()  # again: still one handler, one line per message
        child = logging.getLogger("slimtune.recipes.example")
        child.info("saved step-000002")
        child.debug("not at INFO")
        child.warning("a warning")
        captured = capsys.readouterr()
        assert captured.out == "saved step-000002\n" and captured.err == "a warning\n"
        monkeypatch.setenv("RANK", "1")  # another rank of a torchrun job (no process group in this test)
        child.info("said by rank 0 only")
        child.warning("every rank warns")
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == "every rank warns\n"
        monkeypatch.setenv("SLIMTUNE_DEBUG", "1")
        monkeypatch.setenv("RANK", "0")
        configure_logging()
        child.debug("a closer look")
        assert capsys.readouterr().out == "a closer look\n"
    finally:
        logger.handlers[:] = before[0]
        logger.setLevel(before[1])
