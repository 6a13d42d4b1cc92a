"""Learning-rate schedule for recipes/finetune.py: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Steps 0 .. warmup_steps-1 rise linearly to ``lr`` (lr/warmup_steps at step 0, lr at the last
    warmup step); the remaining steps follow a half cosine from ``lr`` down to
    ``min_lr_ratio * lr``, reached exactly at the last step ``total_steps - 1``.
    """
    min_lr = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
