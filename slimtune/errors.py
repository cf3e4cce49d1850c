"""One exception type for every user-facing failure, and the CLI's exit statuses.

Exit statuses of every ``slimtune`` command: 0 success; 1 ``verify`` found problems; 2 bad input or
environment (one line naming the file, key or tensor and what was expected); 3 internal error (one line
and where to report it; the traceback only with ``SLIMTUNE_DEBUG=1``)."""

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
REPORT_HINT = "this is a bug in slimtune: please report it with the command line (SLIMTUNE_DEBUG=1 prints the traceback)"


class SlimtuneError(Exception):
    """Bad input or an unsafe situation; the message names the file, tensor or key and what was expected."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type name when the message is empty): what a one-line error
    quotes of another library's exception. Example: ``first_line(ValueError("bad\\nmore")) == "bad"``"""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
