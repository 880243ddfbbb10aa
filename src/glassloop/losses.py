"""Losses by name (the config's ``[loss]`` section): torch's own loss classes, mean reduction.

>>> build_loss(LossConfig(name="huber", delta=0.5), num_outputs=1)
HuberLoss()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from glassloop.errors import ConfigError


@dataclass
class LossConfig:
    """The loss by name (``"mean"`` reduction); its options apply where the loss has them.
    ``train.ignore_index`` is the label cross_entropy and nll leave out."""

    name: str = "cross_entropy"  # nll, bce_with_logits, mse, l1, huber, smooth_l1
    label_smoothing: float = 0.0  # cross_entropy
    pos_weight: list[float] = field(default_factory=list)  # bce_with_logits: one per label
    delta: float = 1.0  # huber
    beta: float = 1.0  # smooth_l1


def build_loss(cfg: LossConfig, *, num_outputs: int, ignore_index: int = -100) -> nn.Module:
    """The loss ``cfg.name`` names, with the options that apply to it."""
    if cfg.name == "cross_entropy":
        return nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=cfg.label_smoothing)
    if cfg.name == "nll":
        return nn.NLLLoss(ignore_index=ignore_index)
    if cfg.name == "bce_with_logits":
        if not cfg.pos_weight:
            return nn.BCEWithLogitsLoss()
        if len(cfg.pos_weight) != num_outputs:
            raise ConfigError(
                f"config: loss.pos_weight has {len(cfg.pos_weight)} values for "
                f"{num_outputs} labels; give one per label"
            )
        return nn.BCEWithLogitsLoss(pos_weight=torch.tensor(cfg.pos_weight))
    if cfg.name == "mse":
        return nn.MSELoss()
    if cfg.name == "l1":
        return nn.L1Loss()
    if cfg.name == "huber":
        return nn.HuberLoss(delta=cfg.delta)
    if cfg.name == "smooth_l1":
        return nn.SmoothL1Loss(beta=cfg.beta)
    raise ConfigError(f"config: unknown loss.name {cfg.name!r}")  # the reader lists the names
