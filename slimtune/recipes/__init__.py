"""Training recipes: each one readable top to bottom in its own file (set-up, loop, checkpointing)."""

from slimtune.recipes.finetune import FinetuneResult, run_finetune

__all__ = ["FinetuneResult", "run_finetune"]
