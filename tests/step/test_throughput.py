"""Every epoch row's rates: samples/s of the training part, tokens/s of a language model, and
MFU from the FLOPs torch's counter sees in the first step (a GPU's peak: here one is given,
as a GPU of a known name would give it), without changing a single weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import glassloop.loop
from glassloop import Trainer
from glassloop.distributed.world import World
from glassloop.step.throughput import Throughput


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def test_a_language_model_reports_tokens_per_second_as_samples_times_positions() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (40, 7))
    model = TinyLM()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss,
                      task="language-model", device="cpu", progress="none")  # fmt: skip
    history = trainer.fit([(tokens[i : i + 8], tokens[i : i + 8]) for i in range(0, 40, 8)],
                          epochs=2)  # fmt: skip
    for row in history:  # the same seconds: tokens/s is samples/s times 7 positions
        assert row["tokens_per_s"] == pytest.approx(7 * row["samples_per_s"], rel=1e-12)
        assert "mfu" not in row  # no known peak on a CPU


def test_a_classifier_has_no_tokens_per_second() -> None:
    model = nn.Linear(4, 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      device="cpu", progress="none")  # fmt: skip
    row = trainer.fit([(torch.randn(8, 4), torch.randint(0, 3, (8,)))], epochs=1)[0]
    assert row["samples_per_s"] > 0 and "tokens_per_s" not in row


def fit_linear(peak: float | None, monkeypatch: pytest.MonkeyPatch) -> Trainer:
    monkeypatch.setattr(glassloop.loop, "peak_flops", lambda device, precision: peak)
    torch.manual_seed(0)
    model = nn.Linear(20, 5)
    data = [(torch.randn(8, 20), torch.randint(0, 5, (8,))) for _ in range(6)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      device="cpu", progress="none")  # fmt: skip
    trainer.fit(data, epochs=2)
    return trainer


def test_mfu_is_the_counted_flops_per_sample_times_samples_per_second_over_the_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = fit_linear(1e9, monkeypatch)
    # Linear(20, 5): forward 2*20*5 FLOPs a sample, backward (the weight's gradient) as many;
    # the input needs no gradient.
    for row in counted.history:
        assert row["mfu"] == pytest.approx(400 * row["samples_per_s"] / 1e9, rel=1e-12)
    # Counting FLOPs in the first step changes nothing the step computes.
    plain = fit_linear(None, monkeypatch)
    assert "mfu" not in plain.history[0]
    for a, b in zip(counted.model.state_dict().values(), plain.model.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_a_resumed_epoch_counts_its_rate_from_the_resume() -> None:
    """A resumed epoch's samples before the kill took no time in this process: they are not
    part of its rate."""
    meter = Throughput(tokens=False, peak=None, world=World())
    meter.start(30)  # 30 samples of the epoch were trained before the resume
    meter.started, meter.stopped = 0.0, 2.0
    assert meter.row(50) == {"samples_per_s": 10.0}
