"""``python -m bench load-moe``: the QLoRA load of a synthetic Mixtral of the real widths in a fresh child
process (bench/load_child.py): its peak RSS during the load against what it holds afterwards."""

from __future__ import annotations

from pathlib import Path

from transformers import MixtralConfig

from bench.common import run_child
from slimtune.checkpoint.atomic import is_complete_checkpoint
from slimtune.synthetic import MIXTRAL_WIDTHS, write_synthetic_base


def bench_load_moe(out: Path, layers: int = 2) -> dict:
    """Load a synthetic Mixtral of the real widths (hidden 4096, intermediate 14336, 8 experts; per-expert
    tensors as published) as QLoRA in a fresh child process; its peak RSS during the load against what
    it holds afterwards (the bound: at most the resident NF4 model + 512 MB)."""

    config = MixtralConfig(**MIXTRAL_WIDTHS, num_hidden_layers=layers, dtype="bfloat16")
    base = out / f"mixtral-{layers}l"
    if not is_complete_checkpoint(base):
        write_synthetic_base(config, base)
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    stats = run_child("bench.load_child", str(base), what="load")
    return {
        "model": f"mixtral widths, {layers} layers",
        "base_bytes": base_bytes,
        **{k: round(v, 1) if isinstance(v, float) else v for k, v in stats.items()},
        "peak_over_after_mb": round(stats["peak_rss_mb"] - stats["rss_after_mb"], 1),
        "bound_mb": round(stats["rss_after_mb"] + 512, 1),
        "within_bound": stats["peak_rss_mb"] <= stats["rss_after_mb"] + 512,
    }
