"""A resumable training loader and a plain validation loader over in-memory splits.

Why not torchdata's ``StatefulDataLoader``: with torchdata 0.11 and ``num_workers=0`` its
restored shuffle order differed from an uninterrupted run in our test, mid-epoch and at an
epoch boundary (see meta-pytorch/data issues 1437 and 1440). The state needed here is two
integers: each epoch's order is a permutation drawn from a generator seeded with
``(seed, epoch)``, and the position is the number of batches the loop has consumed, counted
in the main process (so worker prefetching does not matter). Resuming skips indices, never
data: no batch is loaded twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from glassloop.data.datasets import Splits
from glassloop.preemption import ignore_stop_signals


def epoch_seed(seed: int, epoch: int) -> int:
    """A distinct 63-bit seed per (seed, epoch)."""
    return (seed * 1_000_003 + epoch * 7_919 + 12_345) % (2**63 - 1)


class EpochSampler(Sampler[int]):
    """Indices of one epoch: ``randperm`` from a generator seeded by ``(seed, epoch)`` (or
    ``0..n-1`` without shuffling), starting at ``start``. Never touches the global RNG."""

    def __init__(self, num_samples: int, *, shuffle: bool, seed: int) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        return iter(order[self.start :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start


class ResumableLoader:
    """A ``DataLoader`` whose position (epoch, batches consumed) is a ``state_dict``.

    Iterate it once per epoch like a ``DataLoader``; after ``load_state_dict`` the next
    iteration continues at the exact next batch of the saved epoch.

    >>> data = TensorDataset(torch.arange(10))
    >>> a = ResumableLoader(data, batch_size=3, shuffle=True, seed=0)
    >>> full = [b[0].tolist() for b in a]
    >>> b = ResumableLoader(data, batch_size=3, shuffle=True, seed=0)
    >>> b.load_state_dict({"epoch": 0, "batches_consumed": 2})
    >>> [x[0].tolist() for x in b] == full[2:]
    True
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Any = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        self.seed = seed
        self.epoch = 0
        self.batches_consumed = 0
        # Worker seeds come from this generator; it is reseeded per epoch in __iter__, so a
        # resumed epoch gives its workers the same seeds as the uninterrupted one.
        self._generator = torch.Generator()
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            generator=self._generator,
            worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
        )

    def __iter__(self) -> Iterator[Any]:
        self.sampler.epoch = self.epoch
        self.sampler.start = self.batches_consumed * self.batch_size
        self._generator.manual_seed(epoch_seed(self.seed, self.epoch) ^ 0x5EED)
        for batch in self.loader:
            self.batches_consumed += 1  # counted when handed to the loop, not when prefetched
            yield batch
        self.epoch += 1
        self.batches_consumed = 0

    def __len__(self) -> int:
        """Batches in a full epoch."""
        n = self.sampler.num_samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])


def make_loaders(
    splits: Splits,
    *,
    batch_size: int,
    eval_batch_size: int | None = None,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
) -> tuple[ResumableLoader, DataLoader[tuple[torch.Tensor, ...]]]:
    """Resumable training loader (shuffled per epoch from ``seed``) and validation loader.

    >>> from glassloop.config import DataConfig
    >>> from glassloop.data import load_splits
    >>> train, val = make_loaders(load_splits(DataConfig(name="synthetic")), batch_size=32)
    >>> next(iter(train))[0].shape
    torch.Size([32, 32])
    """
    train = ResumableLoader(
        TensorDataset(splits.x_train, splits.y_train),
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    val = DataLoader(
        TensorDataset(splits.x_val, splits.y_val),
        batch_size=eval_batch_size or batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Its own generator: a DataLoader without one draws a seed from the global torch RNG
        # on every iter(), which would shift the dropout masks of all later training steps.
        generator=torch.Generator(),
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
    )
    return train, val
