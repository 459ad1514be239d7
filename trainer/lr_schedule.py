"""Learning-rate schedule: linear warm-up, then cosine decay to lr * min_lr_ratio, then constant.

As in nanoGPT's get_lr, except that the decay length is its own setting (``optim.decay_steps``)
instead of being tied to the run length, so a run can be extended on resume without changing the
learning rates of steps already planned.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based: the first update uses step 0).

    Steps 0 .. warmup_steps-1 ramp linearly to ``lr`` (step s gets lr * (s+1) / warmup_steps);
    the next ``decay_steps`` steps follow a half cosine from lr down to lr * min_lr_ratio;
    later steps stay at lr * min_lr_ratio. ``decay_steps=0`` means no decay: lr after the warm-up.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    min_lr = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_steps == 0:
        return lr
    progress = (step - warmup_steps) / decay_steps
    if progress >= 1.0:
        return min_lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
