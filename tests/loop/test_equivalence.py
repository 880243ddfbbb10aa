"""Trainer.fit equals a hand-written five-step loop, bit for bit (CPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Trainer
from glassloop.config.models import mlp


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


def hand_fit(
    model: nn.Module, batches: DataLoader, loss_fn: nn.Module, epochs: int, clip: float | None,
    val: DataLoader,
) -> None:  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        model.train()
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        # The tutorial's test(): iterating a DataLoader draws its seed from the global RNG,
        # which the next epoch's dropout masks come from, so validation is part of the loop.
        model.eval()
        with torch.no_grad():
            for x, _ in val:
                model(x)


def glassloop_fit(
    model: nn.Module, batches: DataLoader, loss_fn: nn.Module, epochs: int, clip: float | None,
    task: str, val: DataLoader,
) -> Trainer:  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = Trainer(model, optimizer, loss_fn, device="cpu", progress="none", task=task,
                      clip_grad_norm=clip)  # fmt: skip
    trainer.fit(batches, val, epochs=epochs)
    return trainer


def test_regression_with_dropout_bitwise_equal_to_hand_written_loop() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 8, generator=g)
    y = (x[:, :2].sum(1, keepdim=True) + 0.1 * torch.randn(300, 1, generator=g)) * 4
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    torch.manual_seed(99)
    hand_fit(reference, loader(data), nn.HuberLoss(), 3, None, DataLoader(data, batch_size=100))
    torch.manual_seed(99)
    trainer = glassloop_fit(model, loader(data), nn.HuberLoss(), 3, None, "auto",
                            DataLoader(data, batch_size=100))  # fmt: skip
    assert trainer.task == "regression" and "val_r2" in trainer.history[-1]
    assert_bitwise_equal(model, reference)


class TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.rnn = nn.GRU(16, 24, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(24, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(self.embed(tokens))[0])).transpose(1, 2)  # (N, C, T)


def test_language_model_with_padding_and_clipping_bitwise_equal() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 20, (200, 12), generator=g)
    y = torch.roll(x, -1, dims=1)
    y[::3, -3:] = -100  # padded positions: ignored
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    model = TokenLM()
    reference = copy.deepcopy(model)
    torch.manual_seed(99)
    hand_fit(
        reference, loader(data), nn.CrossEntropyLoss(), 2, 1.0, DataLoader(data, batch_size=64)
    )
    torch.manual_seed(99)
    trainer = glassloop_fit(model, loader(data), nn.CrossEntropyLoss(), 2, 1.0,
                            "language-model", DataLoader(data, batch_size=64))  # fmt: skip
    assert "val_perplexity" in trainer.history[-1]
    assert_bitwise_equal(model, reference)
