"""The learning-rate range test (Leslie Smith's "LR finder"): train a copy of the model for
up to ``steps`` steps while the learning rate grows exponentially from ``start`` to ``end``,
and suggest a tenth of the rate where the smoothed loss was lowest. The model, optimizer and
RNG-free state of the trainer are not touched: a copy of the model and a fresh optimizer of
the same class and settings do the steps.

    result = glassloop.lr_find(trainer, train_loader)
    result.suggestion, result.plot("lr.png")
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glassloop.batch import split_batch
from glassloop.data.hf_datasets import loader_for
from glassloop.device import move_to_device
from glassloop.distributed.world import unwrap_model
from glassloop.errors import DataError
from glassloop.evaluation.evaluate import LossFn
from glassloop.storage.atomic import atomic_path
from glassloop.tasks import model_loss

if TYPE_CHECKING:
    from glassloop.loop import Trainer


@dataclass
class LRFind:
    """The tried learning rates, the smoothed loss at each, and the suggested rate."""

    lrs: list[float]
    losses: list[float]
    suggestion: float

    def plot(self, path: str | Path) -> Path:
        """The loss against the learning rate (log scale) as a PNG (matplotlib, headless)."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        path = Path(path)
        figure, axis = plt.subplots(figsize=(6, 4))
        axis.plot(self.lrs, self.losses)
        axis.axvline(self.suggestion, linestyle="--", color="gray")
        axis.set(
            xscale="log",
            xlabel="learning rate",
            ylabel="loss (smoothed)",
            title=f"LR range test: suggested {self.suggestion:.1e}",
        )
        figure.tight_layout()
        with atomic_path(path) as tmp:
            figure.savefig(tmp, dpi=100, format="png")
        plt.close(figure)
        return path


def lr_find(
    trainer: Trainer,
    loader: Iterable[Any],
    *,
    start: float = 1e-7,
    end: float = 10.0,
    steps: int = 100,
) -> LRFind:
    """The range test with ``trainer``'s model, loss and optimizer class (on copies)."""
    model = copy.deepcopy(unwrap_model(trainer.model)).train()
    settings = {k: v for k, v in trainer.optimizer.defaults.items() if k != "lr"}
    cls: Any = type(trainer.optimizer)
    optimizer = cls(model.parameters(), lr=start, **settings)
    return range_test(
        model,
        optimizer,
        trainer.loss_fn,
        loader_for(loader, model=model, shuffle=True),  # (a Hugging Face dataset: batches)
        device=trainer.device,
        start=start,
        end=end,
        steps=steps,
    )


def range_test(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    loader: Iterable[Any],
    *,
    device: torch.device,
    start: float = 1e-7,
    end: float = 10.0,
    steps: int = 100,
) -> LRFind:
    """The range test on ``model`` with ``optimizer`` (both changed: pass copies). Stops
    early when the loss is no longer finite or exceeds 4x its best."""
    if not 0 < start < end or steps < 2:
        raise ValueError(
            f"lr_find needs 0 < start < end and steps >= 2, got {start}, {end}, {steps}"
        )
    lrs: list[float] = []
    losses: list[float] = []
    smooth, best = 0.0, float("inf")
    batches = _cycle(loader)
    for i in range(steps):
        lr = start * (end / start) ** (i / (steps - 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        (args, kwargs), target = split_batch(
            move_to_device(next(batches), device), labels_to_model=loss_fn is None
        )
        output = model(*args, **kwargs)
        loss = loss_fn(output, target) if loss_fn is not None else model_loss(output)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        if not math.isfinite(value):
            break
        smooth = value if i == 0 else 0.9 * smooth + 0.1 * value  # (losses are noisy)
        lrs.append(lr)
        losses.append(smooth)
        best = min(best, smooth)
        if smooth > 4 * best and i > 10:
            break
    if not losses:
        raise DataError(f"lr_find: the loss was not finite even at lr {start:g}")
    return LRFind(lrs, losses, lrs[losses.index(min(losses))] / 10)


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError("lr_find: the loader yielded no batches")
