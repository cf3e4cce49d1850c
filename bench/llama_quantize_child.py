"""The quantize stage of ``python -m bench gguf --peer llama.cpp`` for a K-quant mix:
``python -m bench.llama_quantize_child IN.gguf OUT.gguf MIX THREADS`` runs llama.cpp's own
``llama_model_quantize`` (llama-cpp-python, no importance matrix) and prints one JSON line: seconds and
the peak RSS of this whole process (interpreter, imports, quantization), as /usr/bin/time -v reports it."""

from __future__ import annotations

import json
import sys
import time

import llama_cpp

from slimtune.gguf.mix import MIXES
from slimtune.memory import peak_rss_mb


def main(argv: list[str]) -> None:
    src, out, mix, threads = argv
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(MIXES[mix][1]), int(threads)
    t0 = time.perf_counter()
    if llama_cpp.llama_model_quantize(src.encode(), out.encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {out} ({mix}) failed")
    print(json.dumps({"quantize_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main(sys.argv[1:])
