"""Losses by name (the config's ``[loss]`` section): torch's own loss classes, mean reduction.

>>> build_loss(LossConfig(name="huber", delta=0.5), num_outputs=1)
HuberLoss()
"""

from __future__ import annotations

import torch
from torch import nn

from glassloop.config.sections import LossConfig
from glassloop.errors import ConfigError


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
