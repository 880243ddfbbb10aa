"""The loss-spike guard (``loss_spike``): a finite but wild batch stops the run naming its
step, epoch and batch; a resume measures against the same window of losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from regression_data import linear_batches
from torch import nn

from glassloop import Trainer
from glassloop.options import CheckpointConfig


def test_a_loss_spike_stops_the_run_naming_its_step_and_batches(tmp_path: Path) -> None:
    """A finite but wild batch (targets x1000) at batch 7 of epoch 3: with loss_spike=10 the
    run stops there, naming step, epoch and batch; nothing after it is saved. Off (0), the
    same data trains on."""
    from glassloop.step.guards import LossSpikeError

    batches = linear_batches(n=160, batch=16)  # 10 batches an epoch
    wild = [(x, y * 1000 if i == 6 else y) for i, (x, y) in enumerate(batches)]

    class Epochs:  # clean epochs 1-2, the wild batch in epoch 3
        def __init__(self) -> None:
            self.epoch = 0

        def __iter__(self) -> Any:
            self.epoch += 1
            return iter(wild if self.epoch == 3 else batches)

    def make(spike: float, run_dir: Path | None) -> Trainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        return Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), device="cpu",
            progress="none", loss_spike=spike, run_dir=run_dir, log_every=4,
            checkpoint=CheckpointConfig(every_n_steps=4, every_n_epochs=0),
        )  # fmt: skip

    with pytest.raises(LossSpikeError, match=r"loss spike at step 27 \(epoch 3, batch 7\)"):
        make(10.0, tmp_path / "run").fit(Epochs(), epochs=3)
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-00000024"  # the step-28 row found it; nothing after 27 saved
    assert len(make(0.0, None).fit(Epochs(), epochs=3)) == 3

    # Resumed from step 24 (epoch 3, batch 4) by a new Trainer: the guard measures step 27
    # against the same 20 losses as the uninterrupted run (they are in the checkpoint), so
    # it stops at the same step. (Before: a resume started an empty window and trained on.)
    resumed, rest = make(10.0, tmp_path / "run"), Epochs()
    rest.epoch = 2  # its next epoch is the third, the one with the wild batch
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000024"
    with pytest.raises(LossSpikeError, match=r"loss spike at step 27 \(epoch 3, batch 7\)"):
        resumed.fit(rest, epochs=3, resume=checkpoint)
