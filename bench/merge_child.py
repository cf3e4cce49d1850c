"""The child of ``python -m bench merge``: ``python -m bench.merge_child BASE ADAPTER OUT DEVICE verify|no-verify`` runs
``merge_from_files`` and prints one JSON line of its own figures (seconds, seconds per stage, bytes read
and written, peak RSS of this whole process: interpreter, imports, merge). It imports what ``slimtune
merge`` does and no more."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from slimtune.checkpoint.writer import WriteOptions
from slimtune.formats.merge_source import MergeSource
from slimtune.memory import bytes_read_by_process, bytes_written_by_process, peak_rss_mb
from slimtune.merge import merge_from_files
from slimtune.profiler import timing_stages


def main(argv: list[str]) -> None:
    base, adapter, out, device, check = argv
    r0, w0, t0 = bytes_read_by_process(), bytes_written_by_process(), time.perf_counter()
    with timing_stages() as profile:  # no synchronisation added: GPU work shows up where the copy to the host waits for it
        result = merge_from_files(
            MergeSource(base, Path(adapter), verify=check == "verify"), out, WriteOptions(overwrite=True, progress=True, device=device)
        )
    figures = {
        "merge_s": time.perf_counter() - t0,
        "stages_s": {k: round(v, 3) for k, v in sorted(profile.seconds.items())},
        "bytes_read": bytes_read_by_process() - r0,
        "bytes_written": bytes_written_by_process() - w0,
        "output_bytes": result.total_bytes,
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
