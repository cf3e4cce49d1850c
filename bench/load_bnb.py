"""``python -m bench load-bnb``: the training load of a bitsandbytes 4-bit checkpoint of the Llama-3-8B shape
(what an Unsloth ``*-bnb-4bit`` repo holds: NF4, double quant, lm_head and embeddings bf16), beside today's load
of the same shape from a bf16 base (NF4-quantized by torchao as it arrives). Each in a fresh child process
(bench/load_child.py): seconds, peak RSS (VmHWM reset before the load) and what the model holds, against the
files' size. The synthetic bases are written under --out once and reused."""

from __future__ import annotations

import os
from pathlib import Path

from bench.common import run_child
from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.synthetic import preset_config, write_synthetic_base, write_synthetic_bnb_base


def bench_load_bnb(out: Path, layers: int | None = None, bf16_layers: int | None = None) -> dict:
    """The 4-bit base of ``layers`` layers (default: all 32) and the bf16 base of ``bf16_layers`` (default: the
    same; 0: not measured), loaded as slimtune training loads them (default LoRA targets)."""
    rows = {}
    for kind, n, write in (
        ("bnb-4bit", layers, write_synthetic_bnb_base),
        ("bf16", layers if bf16_layers is None else bf16_layers, write_synthetic_base),
    ):
        if n == 0:
            continue
        config = preset_config("llama3-8b", **({"num_hidden_layers": n} if n else {}))
        label = f"llama3-8b[{config.num_hidden_layers} layers]"
        base = out / f"{kind}-{config.num_hidden_layers}l"
        if not is_complete_checkpoint(base):
            write(config, base)
        files = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        stats = run_child("bench.load_child", str(base), what=f"{kind} load")
        rows[kind] = {
            "shape": label,
            "files_mb": round(files / 2**20, 1),
            **{k: round(v, 1) if isinstance(v, float) else v for k, v in stats.items() if "expert" not in k},
            "peak_over_files_mb": round(stats["peak_rss_mb"] - files / 2**20, 1),
        }
    return rows | {"load_average": round(os.getloadavg()[0], 1)}
