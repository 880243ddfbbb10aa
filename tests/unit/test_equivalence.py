"""Trainer.fit equals a hand-written five-step loop, bit for bit (CPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Trainer
from glassloop.models import mlp


def make_data(n: int = 700) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(x, y)


def loader(data: TensorDataset) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(7))


def hand_loop(model: nn.Module, data: TensorDataset, epochs: int, scheduler_step: bool) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()
    dl = loader(data)
    for _ in range(epochs):
        model.train()
        for x, y in dl:
            pred = model(x)
            loss = loss_fn(pred, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if scheduler_step:
                scheduler.step()
        if not scheduler_step:
            scheduler.step()


def run_both(dropout: float, interval: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = mlp((1, 28, 28), 10, [512, 512], dropout)
    initial = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    data = make_data()

    torch.manual_seed(99)  # same global RNG (dropout masks) for both runs
    hand_loop(reference, data, epochs=2, scheduler_step=interval == "step")

    torch.manual_seed(99)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    trainer = Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler=scheduler,
        scheduler_interval=interval,
        device="cpu",
        progress="none",
    )
    trainer.fit(loader(data), epochs=2)
    return model, reference, initial


def assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_tutorial_mlp_bitwise_equal_to_hand_written_loop() -> None:
    model, reference, initial = run_both(dropout=0.0, interval="epoch")
    assert_bitwise_equal(model, reference)
    # The runs really trained: weights moved away from the initial ones.
    assert not torch.equal(model.state_dict()["1.weight"], initial.state_dict()["1.weight"])


def test_dropout_and_per_step_scheduler_bitwise_equal() -> None:
    model, reference, _ = run_both(dropout=0.2, interval="step")
    assert_bitwise_equal(model, reference)
