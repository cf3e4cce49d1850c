"""Training: the one loop (``finetune.run_finetune``) and its objectives (``objectives/``), read top to bottom."""

from slimtune.recipes.finetune import FinetuneResult, run_finetune

__all__ = ["FinetuneResult", "run_finetune"]
