"""The learning-rate schedule of every recipe: linear warmup, then cosine decay to a floor.

Example::

    factor = partial(warmup_cosine, warmup=10, total=100, min_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor for optimizer step ``step`` (0-based): linear warmup to 1, then cosine to min_ratio.

    Example: ``warmup_cosine(0, warmup=2, total=10, min_ratio=0.0) == 0.5``"""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
