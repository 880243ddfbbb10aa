"""DataLoaders over in-memory splits, shuffled by their own seeded generator.

The generator matters: a ``DataLoader`` without one draws its shuffle seed from the global
torch RNG, which shifts every later dropout mask and makes runs hard to reproduce.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from glassloop.data.datasets import Splits


def make_loaders(
    splits: Splits,
    *,
    batch_size: int,
    eval_batch_size: int | None = None,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """Training loader (shuffled with a generator seeded by ``seed``) and validation loader.

    >>> from glassloop.config import DataConfig
    >>> from glassloop.data import load_splits
    >>> train, val = make_loaders(load_splits(DataConfig(name="synthetic")), batch_size=32)
    >>> next(iter(train))[0].shape
    torch.Size([32, 32])
    """
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        TensorDataset(splits.x_train, splits.y_train),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
    val = DataLoader(
        TensorDataset(splits.x_val, splits.y_val),
        batch_size=eval_batch_size or batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
    return train, val
