"""A user model for the preemption tests: an MLP with dropout whose forward takes a moment
(PAUSE_S in training, EVAL_PAUSE_S in evaluation), so that a signal sent at a random time
lands in a step, a validation or between them, and that says on stderr when a validation
begins ("validating"), so a test can send a signal inside one. Tests copy this file next to
their config and point model.target at it."""

import os
import sys
import time

import torch
from torch import nn

from glassloop.config.models import mlp


class PreemptibleMLP(nn.Module):
    def __init__(self, features: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.net = mlp((features,), classes, [64], 0.2)
        self.pause = float(os.environ.get("PAUSE_S", "0"))
        self.eval_pause = float(os.environ.get("EVAL_PAUSE_S", "0"))
        self.validating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and not self.validating:
            print("validating", file=sys.stderr, flush=True)
        self.validating = not self.training
        time.sleep(self.pause if self.training else self.eval_pause)
        out: torch.Tensor = self.net(x)
        return out
