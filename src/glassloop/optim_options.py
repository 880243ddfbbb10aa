"""The ``[optim]`` and ``[scheduler]`` sections of a config: a ``torch.optim`` class and a
``torch.optim.lr_scheduler`` class by name, and their keyword arguments. Owned here,
torch-free, next to :mod:`glassloop.optimizers` that checks the arguments against the classes
and builds them (so that reading a config imports no torch); :mod:`glassloop.config`
composes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glassloop.options import SCHEDULER_INTERVALS, option
from glassloop.rules import Range


@dataclass
class OptimConfig:
    """Any ``torch.optim`` class by name; other keys are its keyword arguments."""

    name: str = "AdamW"
    lr: float = option(1e-3, rule=Range(0, open_low=True))  # lr = 0 trains nothing, silently
    no_decay_bias_norm: bool = False  # biases and norm weights (1-D params) get weight_decay 0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    """Any ``torch.optim.lr_scheduler`` class by name (``"none"`` for none); other keys are
    its keyword arguments. ``CosineAnnealingLR`` without ``T_max`` spans the whole run.
    ``"warmup_cosine"`` (built in, per optimizer step): linear warmup over ``warmup_steps``,
    then cosine down to ``min_lr_ratio`` x lr at the end of the run."""

    name: str = "CosineAnnealingLR"
    interval: str = option("epoch", rule=SCHEDULER_INTERVALS)
    kwargs: dict[str, Any] = field(default_factory=dict)


# The default optimizer's keyword arguments as the resolved config records them (its own
# numeric defaults, read off AdamW's signature by glassloop.optimizers.optimizer_kwargs), so
# that reading a config that leaves [optim] alone needs no torch (importing it takes ~1.7 s).
# tests/unit/test_config.py checks them against the installed torch's.
DEFAULT_OPTIM_KWARGS: dict[str, Any] = {
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
}
