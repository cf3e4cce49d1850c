"""``python -m bench NAME [flags]``: see bench/cli.py."""

from bench.cli import main

main()
