"""Regressions for the tests: scikit-learn's diabetes set written as a CSV, and the settings
a run of it takes from the command line (the CLI's task tests and FSDP's regression plot);
a small linear one in batches (the closure optimizer's and the loss-spike guard's tests)."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from sklearn.datasets import load_diabetes


def diabetes_csv(path: Path) -> Path:
    data = load_diabetes()
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([*data.feature_names, "progression"])
        for row, target in zip(data.data, data.target, strict=True):
            writer.writerow([*(f"{v:.6f}" for v in row), f"{target / 100:.4f}"])
    return path


REGRESSION = [
    "data.name=csv", "data.label_column=progression", "loss.name=mse", "model.hidden=[32]",
    "train.epochs=4", "optim.lr=0.01", "data.batch_size=32", "train.progress=none",
    "checkpoint.monitor=val_r2", "train.metrics=['explained_variance']",
]  # fmt: skip


def linear_batches(n: int = 64, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` rows of 5 features and a noisy linear target, in batches, seeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.randn(5, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return list(zip(x.split(batch), y.split(batch), strict=True))
