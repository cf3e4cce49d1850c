"""The child of ``python -m bench load-moe``: ``python -m bench.load_child BASE`` loads the checkpoint as
QLoRA and prints one JSON line: seconds, RSS before / at peak / after, the bytes the model holds
(``quant.resident_bytes``: NF4 codes, scalers and factors, or the plain tensor), the largest expert
tensor in bf16 and the number of expert pieces."""

from __future__ import annotations

import json
import sys
import time

from slimtune.families import NF4Experts
from slimtune.lora import LoRAConfig
from slimtune.memory import peak_rss_mb, reset_peak_rss, rss_mb
from slimtune.model import load_qlora_model
from slimtune.quant import resident_bytes


def main(argv: list[str]) -> None:
    (base,) = argv
    before = rss_mb()
    reset_peak_rss()
    start = time.perf_counter()
    model = load_qlora_model(base, LoRAConfig(), progress=False)
    seconds = time.perf_counter() - start
    peak, after = peak_rss_mb(), rss_mb()
    resident = sum(resident_bytes(p) for p in model.parameters()) / 2**20
    experts = [m for m in model.modules() if isinstance(m, NF4Experts)]
    largest = max((p.numel() * 2 for m in experts for p in m.pieces.values()), default=0) / 2**20
    figures = dict(load_s=seconds, rss_before_mb=before, peak_rss_mb=peak, rss_after_mb=after, model_mb=resident)
    print(json.dumps(figures | dict(largest_expert_tensor_bf16_mb=largest, expert_pieces=sum(len(m.pieces) for m in experts))))


if __name__ == "__main__":
    main(sys.argv[1:])
