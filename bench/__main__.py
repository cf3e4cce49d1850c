"""``python -m bench NAME [flags]``: see bench/cli.py. The benches run under the command's OpenMP wait
policy (``slimtune.cli.set_openmp_wait_policy``, set before torch loads), as ``slimtune`` itself does."""

from slimtune.cli import set_openmp_wait_policy

set_openmp_wait_policy()

from bench.cli import main  # noqa: E402  (torch loads here, after the wait policy is set)

main()
