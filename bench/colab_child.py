"""The child of ``python -m bench.gpu_check colab``: ``python -m bench.colab_child KEY=VALUE ...`` runs the
recipe with the shipped llama3-8b_qlora config and those overrides, and prints one line ``RESULT {json}``:
steps, losses, the host's peak RSS (of this whole process), peak VRAM, the last save's seconds and bytes,
and the peak RSS during that save."""

from __future__ import annotations

import json
import sys

from slimtune.config import load_config
from slimtune.recipes.finetune import run_finetune


def main(overrides: list[str]) -> None:
    r = run_finetune(load_config("llama3-8b_qlora", overrides))
    figures = {"steps": r.global_step, "losses": r.losses, "host_peak_rss_mb": r.peak_rss_mb, "peak_vram_mb": r.peak_gpu_mb}
    figures |= {"save_s": r.last_save.seconds, "save_bytes": r.last_save.total_bytes, "peak_rss_during_save_mb": r.peak_rss_last_save_mb}
    print("RESULT " + json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
