"""The built-in learning-rate schedule: linear warmup, then cosine decay, defined in steps."""

from __future__ import annotations

import math

import torch


class WarmupCosine:
    """The LR multiplier at optimizer step ``s``: ``s / warmup_steps`` during warmup, then a
    half cosine from 1 down to ``min_lr_ratio`` at ``total_steps``.

    A class rather than a lambda so that ``LambdaLR.state_dict()`` stores its numbers (and
    a checkpoint can restore it without pickle).

    >>> f = WarmupCosine(warmup_steps=10, total_steps=110)
    >>> f(0), f(5), f(10), round(f(60), 6), f(110)
    (0.0, 0.5, 1.0, 0.5, 0.0)
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with :class:`WarmupCosine`; step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio)
    )
