"""The child of ``python -m bench gguf``: ``python -m bench.gguf_child BASE ADAPTER OUT TYPE VERIFY`` exports the
GGUF file and prints one JSON line: seconds, bytes written, the export's own report, RSS before (after
imports) and at peak (reset with clear_refs first)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from slimtune.gguf_export import GGUFOptions, export_gguf
from slimtune.memory import bytes_written_by_process, peak_rss_mb, reset_peak_rss, rss_mb


def main(argv: list[str]) -> None:
    base, adapter, out, qtype, verify = argv
    before = rss_mb()
    reset = reset_peak_rss()
    w0, t0 = bytes_written_by_process(), time.perf_counter()
    result = export_gguf(Path(out), GGUFOptions(qtype, overwrite=True, verify=verify == "True"), base=Path(base), adapter=Path(adapter))
    figures = {"export_s": time.perf_counter() - t0, "bytes_written": bytes_written_by_process() - w0}
    figures |= {"reported_bytes": result.bytes, "tensors": result.tensors, "rss_before_mb": before}
    print(json.dumps(figures | {"peak_rss_mb": peak_rss_mb(), "peak_reset": reset}))


if __name__ == "__main__":
    main(sys.argv[1:])
