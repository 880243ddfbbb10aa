"""Training shapes beyond one model, one optimizer, one loss: each bitwise against the loop a
user would write by hand, and resumed exactly.

- An optimizer whose ``step`` takes a closure (LBFGS, as pytorch/examples'
  time-sequence prediction uses it) through the default ``train_step``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from glassloop import ConfigError, Trainer
from glassloop.checkpointer import CheckpointConfig


def data(n: int = 64, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.randn(5, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def lbfgs_model() -> tuple[nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)


def hand_lbfgs(epochs: int, accumulate: int = 1) -> tuple[nn.Module, list[float]]:
    """What the time-sequence example does: ``optimizer.step(closure)``; with
    ``accumulate`` batches, the closure's objective is their sample-weighted mean."""
    model, optimizer = lbfgs_model()
    batches, losses = data(), []
    for _ in range(epochs):
        for i in range(0, len(batches), accumulate):
            window = batches[i : i + accumulate]
            total = sum(len(y) for _, y in window)

            def closure(window: Any = window, total: int = total) -> torch.Tensor:
                optimizer.zero_grad()
                loss = torch.zeros(())
                for x, y in window:
                    part = nn.functional.mse_loss(model(x), y)
                    if accumulate > 1:
                        part = part * (len(y) / total)
                    part.backward()
                    loss = loss + part.detach()
                return loss

            losses.append(float(optimizer.step(closure)))  # type: ignore[arg-type]
    return model, losses


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_closure_optimizer_trains_as_its_hand_loop(accumulate: int) -> None:
    expected, hand_losses = hand_lbfgs(epochs=2, accumulate=accumulate)
    model, optimizer = lbfgs_model()
    trainer = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", log_every=1,
        grad_accum_steps=accumulate,
    )  # fmt: skip
    history = trainer.fit(data(), epochs=2)
    for ours, theirs in zip(
        model.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)
    # Each step's loss is the one the optimizer's first evaluation returned (as by hand).
    half = len(hand_losses) // 2
    assert history[0]["train_loss"] == pytest.approx(sum(hand_losses[:half]) / half, rel=1e-6)


def test_a_closure_optimizer_resumes_exactly(tmp_path: Path) -> None:
    expected, _ = hand_lbfgs(epochs=3)
    model, optimizer = lbfgs_model()
    first = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", run_dir=tmp_path / "run",
        checkpoint=CheckpointConfig(every_n_steps=3, every_n_epochs=0),
    )  # fmt: skip
    first.fit(data(), epochs=1)  # (the last checkpoint: the end of epoch 1, step 4)
    model, optimizer = lbfgs_model()  # a fresh model and optimizer, as a new process builds
    again = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", run_dir=tmp_path / "run",
        checkpoint=CheckpointConfig(every_n_steps=3, every_n_epochs=0),
    )  # fmt: skip
    again.fit(data(), epochs=3, resume="auto")
    for ours, theirs in zip(
        model.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"clip_grad_norm": 1.0}, "gradient clipping"),
        ({"nonfinite": "strict"}, "train.nonfinite = 'strict'"),
        ({"precision": "fp16"}, "train.precision = 'fp16'"),
    ],
)
def test_what_a_closure_optimizer_does_not_support_is_one_line(
    options: dict[str, Any], refused: str
) -> None:
    model, optimizer = lbfgs_model()
    with pytest.raises(ConfigError, match=f"closure .LBFGS. does not support {refused}"):
        Trainer(model, optimizer, nn.MSELoss(), device="cpu", progress="none", **options)
