"""Activation checkpointing (``activation_checkpointing=["Block"]``): the named modules keep
only their inputs for backward, and the weights are bitwise those of a run without it; a name
that matches no module is one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from glassloop import ConfigError, Trainer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(4 * width, width),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def blocks_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), *(Block(32) for _ in range(3)), nn.Linear(32, 3))


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the activations autograd keeps for backward in one training forward."""
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).sum().backward()
    model.zero_grad()
    return total[0]


def test_activation_checkpointing_keeps_less_and_trains_bitwise_the_same() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    batches = list(zip(x.split(16), y.split(16), strict=True))
    weights, kept = [], []
    for names in ([], ["Block"]):
        model = blocks_model()
        trainer = Trainer(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
            device="cpu", progress="none", activation_checkpointing=names,
        )  # fmt: skip
        torch.manual_seed(5)  # (dropout draws from here, the same in both)
        trainer.fit(batches, epochs=2)
        weights.append(model.state_dict())
        kept.append(saved_bytes(model, x))
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert kept[1] < kept[0] / 2, kept  # (only the blocks' inputs are kept for them)


def test_an_activation_checkpointing_name_that_matches_nothing_is_one_line() -> None:
    model = blocks_model()
    with pytest.raises(ConfigError, match=r"names \['TransformerBlock'\].*it has: .*Block"):
        Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
            device="cpu", progress="none", activation_checkpointing=["TransformerBlock"],
        )  # fmt: skip
