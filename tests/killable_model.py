"""A user model for the kill tests: an MLP with dropout that SIGKILLs its own process at the
training forward number KILL_AT_FORWARD (in the process whose RANK is KILL_RANK, when that is
set), so a kill -9 lands at an exact step, in the middle of it; under torchrun's elastic mode
only in its first attempt (TORCHELASTIC_RESTART_COUNT 0), so the restarted job goes on.
Tests copy this file next to their config and point model.target at it. DROPOUT (0.2): its
dropout; OOM_ABOVE/OOM_RANK: an out-of-memory error above that many rows, in that process."""

import os
import signal

import torch
from torch import nn

from glassloop.config.models import mlp


class KillableMLP(nn.Module):
    def __init__(self, features: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.net = mlp((features,), classes, [64], float(os.environ.get("DROPOUT", "0.2")))
        # OOM_ABOVE: out of memory above that many rows while training, in the process whose
        # RANK is OOM_RANK (micro_batch_size = "auto" settles on what fits)
        oom_mine = os.environ.get("RANK", "0") == os.environ.get("OOM_RANK", "0")
        self.oom_above = int(os.environ.get("OOM_ABOVE", "0")) if oom_mine else 0
        self.calls = 0
        rank = os.environ.get("KILL_RANK")
        mine = rank is None or os.environ.get("RANK", "0") == rank
        mine = mine and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill_at = int(os.environ.get("KILL_AT_FORWARD", "0")) if mine else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.oom_above and x.shape[0] > self.oom_above:
                raise torch.OutOfMemoryError("CUDA out of memory (KillableMLP's OOM_ABOVE)")
        out: torch.Tensor = self.net(x)
        return out
