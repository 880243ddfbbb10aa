"""How ``fit`` takes the loaders it is given: one ``iter()`` per epoch, even of a loader whose
``__iter__`` starts it over and returns itself (Ray's ``prepare_data_loader``); the data a
step trains on is the hand loop's, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from glassloop import Trainer
from glassloop.data import make_loader
from glassloop.options import CheckpointConfig
from glassloop.step.throughput import TIMING


class Rewinding(DataLoader):  # type: ignore[type-arg]
    """The shape of Ray's ``_WrappedDataLoader``: a ``DataLoader`` holding another one's
    attributes, whose ``__iter__`` starts the inner loader over (a draw of the global RNG:
    its shuffle) and returns ``self``, with ``__next__``; it counts both."""

    def __init__(self, base: DataLoader) -> None:  # type: ignore[type-arg]
        self.__dict__.update(base.__dict__)
        self._dataloader, self.iterations, self.served = base, 0, 0

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Rewinding:
        self.iterations += 1
        self.inner: Iterator[Any] = iter(self._dataloader)
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.served += 1
        return batch


class Dies(Exception):
    """Raised from a forward: stands in for a killed process."""


class Net(nn.Module):
    """Dropout (the global RNG) and, when asked, death at training forward ``die_at``."""

    def __init__(self, die_at: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.forwards, self.die_at = 0, die_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
            if self.forwards == self.die_at:
                raise Dies
        out: torch.Tensor = self.net(x)
        return out


def rewinding() -> Rewinding:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 3, (80,), generator=g))
    return Rewinding(DataLoader(data, batch_size=16, shuffle=True))  # (5 batches an epoch)


def trainer(model: nn.Module, run_dir: Path | None = None, **options: Any) -> Trainer:
    every = CheckpointConfig(every_n_steps=1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   device="cpu", progress="none", run_dir=run_dir, checkpoint=every,
                   **options)  # fmt: skip


def test_a_loader_that_is_its_own_iterator_is_iterated_once_per_epoch(tmp_path: Path) -> None:
    """Each batch trains once, one ``iter()`` an epoch and a validation: the weights (dropout
    too: the global RNG drawn as the hand loop draws it, the validation's shuffle included)
    equal the hand loop's bit for bit; a validation of its first batches (``limit_batches``)
    iterates it once; and a run killed mid-epoch resumes with one ``iter()`` of the epoch it
    goes on in, equal to the hand loop too."""
    torch.manual_seed(0)
    start = Net()
    by_hand, loader, val = copy.deepcopy(start), rewinding(), rewinding()
    optimizer, loss_fn = torch.optim.SGD(by_hand.parameters(), lr=0.1), nn.CrossEntropyLoss()
    torch.manual_seed(5)
    for _ in range(2):
        by_hand.train()
        for x, y in loader:
            loss_fn(by_hand(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        by_hand.eval()
        with torch.no_grad():
            for x, _ in val:
                by_hand(x)

    torch.manual_seed(5)
    fitted, loader, val = trainer(copy.deepcopy(start)), rewinding(), rewinding()
    fitted.fit(loader, val, epochs=2)
    assert (fitted.state.step, loader.served, loader.iterations) == (10, 10, 2)
    assert (val.served, val.iterations) == (10, 2)
    for name, tensor in by_hand.state_dict().items():
        assert torch.equal(fitted.model.state_dict()[name], tensor), name
    loader, val = rewinding(), rewinding()
    trainer(Net(), limit_batches=2).fit(loader, val, epochs=1)
    assert (loader.iterations, loader.served, val.iterations, val.served) == (1, 2, 1, 2)

    # Killed in step 8 (epoch 2, batch 3), resumed from step 7's checkpoint in a new Trainer.
    killed = Net(die_at=8)
    killed.load_state_dict(start.state_dict())
    torch.manual_seed(5)
    with pytest.raises(Dies):
        trainer(killed, tmp_path / "run").fit(rewinding(), rewinding(), epochs=2)
    resumed, loader = trainer(Net(), tmp_path / "run"), rewinding()
    resumed.fit(loader, rewinding(), epochs=2, resume="auto")
    assert (loader.iterations, loader.served) == (1, 5)  # the epoch's 2 replayed, 3 trained
    for name, tensor in by_hand.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_a_distributed_samplers_epoch_is_set_each_epoch_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """``fit`` calls ``set_epoch`` as a hand-written loop must (the same order every epoch
    without it): one process's shard of a ``DistributedSampler`` trains as the hand loop
    with ``set_epoch`` does, bit for bit, and a run killed in epoch 2 resumes equal to it."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))

    def loader() -> DataLoader:  # type: ignore[type-arg]
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        return DataLoader(data, batch_size=8, sampler=sampler)  # (4 batches an epoch)

    torch.manual_seed(0)
    start = Net()
    by_hand, batches = copy.deepcopy(start), loader()
    optimizer, loss_fn = torch.optim.SGD(by_hand.parameters(), lr=0.1), nn.CrossEntropyLoss()
    torch.manual_seed(5)
    for epoch in range(2):
        batches.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in batches:
            loss_fn(by_hand(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    killed = Net(die_at=6)  # (step 6: epoch 2, batch 2)
    killed.load_state_dict(start.state_dict())
    torch.manual_seed(5)
    with pytest.raises(Dies):
        trainer(killed, tmp_path / "run").fit(loader(), epochs=2)
    resumed = trainer(Net(), tmp_path / "run")
    resumed.fit(loader(), epochs=2, resume="auto")
    for name, tensor in by_hand.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_a_new_trainer_starts_glassloop_loaders_at_their_first_epoch() -> None:
    """A notebook's "new model, new Trainer, fit" run again with the same loader objects
    (training, and validation sets by name, all shuffled), after a peek at each as
    ``doctor`` takes one: every weight and row equals the same fit with fresh loaders (a
    fresh kernel), bit for bit. ``fit`` again on the same Trainer continues it: ``fit(...,
    epochs=1)`` then ``fit(..., epochs=2)`` is one ``fit(..., epochs=2)``."""

    def loaders() -> tuple[Any, dict[str, Any]]:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
        train = make_loader((x, y), batch_size=8, shuffle=True, seed=3)
        sets = {name: make_loader((x[i::2], y[i::2]), batch_size=4, shuffle=True, seed=i)
                for i, name in enumerate(("a", "b"))}  # fmt: skip
        return train, sets

    def fit(train: Any, sets: dict[str, Any], *epochs: int) -> Trainer:
        torch.manual_seed(0)
        fitted = trainer(Net(), limit_batches=3)  # (3 batches of 8 validation batches)
        for total in epochs:
            fitted.fit(train, sets, epochs=total)
        return fitted

    def same(a: Trainer, b: Trainer) -> None:
        for name, tensor in a.model.state_dict().items():
            assert torch.equal(b.model.state_dict()[name], tensor), name
        rows = [
            [{k: v for k, v in r.items() if k not in TIMING} for r in t.history] for t in (a, b)
        ]
        assert rows[0] == rows[1]

    fresh = fit(*loaders(), 2)
    train, sets = loaders()
    fit(train, sets, 2)
    for loader in (train, *sets.values()):
        next(iter(loader))
    same(fit(train, sets, 2), fresh)
    same(fit(*loaders(), 1, 2), fresh)
