"""One exception type for every user-facing failure, so the CLI can print it and exit non-zero."""


class SlimtuneError(Exception):
    """Bad input or an unsafe situation; the message names the file, tensor or key and what was expected."""
