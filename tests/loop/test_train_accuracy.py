"""train_accuracy: counted as the run trains (the step's first forward), refused where it
means nothing, shown running on the bar with live validation numbers."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn


def test_train_accuracy_is_counted_as_it_trains_and_refused_where_it_means_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Keras's running accuracy (issue 37, item 10), opt-in: the epoch row's train_accuracy
    is the share of the labels each step's forward got right (a hand count here); a
    regression or a model computing its own loss is refused in one line."""
    import glassloop
    from glassloop.errors import ConfigError

    torch.manual_seed(0)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(5)]
    model = nn.Linear(6, 3)
    hand = nn.Linear(6, 3)
    hand.load_state_dict(model.state_dict())
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                nn.CrossEntropyLoss(), progress="lines",
                                train_accuracy=True)  # fmt: skip
    trainer.fit(data, epochs=2)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    for epoch in range(2):
        right = 0
        for x, y in data:
            out = hand(x)
            right += int((out.argmax(-1) == y).sum())
            nn.functional.cross_entropy(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert trainer.history[epoch]["train_accuracy"] == right / 80
    assert f"train_accuracy {100 * right / 80:.2f}%" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="train_accuracy counts a classifier's labels with a "
                       "loss function; this run's task is 'regression'"):  # fmt: skip
        glassloop.Trainer(nn.Linear(6, 1), torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.MSELoss(), train_accuracy=True)  # fmt: skip
    with pytest.raises(ConfigError, match="the model's own loss"):
        glassloop.Trainer(nn.Linear(6, 1), torch.optim.SGD(model.parameters(), lr=0.1), None,
                          task="classification", train_accuracy=True)  # fmt: skip


def test_the_bar_shows_running_accuracy_and_live_validation_numbers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's live numbers (issue 37, item 10): the training bar's running loss and
    accuracy, the last mid-epoch validation's val_loss/val_acc in it, and the validation
    bar's running numbers as it goes."""
    import time

    import glassloop
    from glassloop.tracking.console import ProgressReporter

    monkeypatch.setattr(ProgressReporter, "REFRESH_S", 0.0)
    monkeypatch.setattr(ProgressReporter, "VAL_REFRESH_S", 0.0)

    class Slow(nn.Linear):  # (each batch takes long enough for the bars to redraw)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.03)
            return super().forward(x)

    torch.manual_seed(0)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(12)]
    model = Slow(6, 3)
    glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      progress="bar", train_accuracy=True,
                      validate_every_n_steps=6).fit(data, data[:8], epochs=1)  # fmt: skip
    said = capsys.readouterr()
    bars = said.err
    # the mid-epoch validation's line: its own line above the bar, accuracy as the bar has it
    both = said.out + said.err
    line = next(part for part in re.split(r"[\r\n]", both) if "step 6: val_loss" in part)
    assert re.fullmatch(r"step 6: val_loss \d\.\d+, val_accuracy \d+\.\d\d%", line), line
    assert re.search(r"epoch 1/1.*loss=\d\.\d{4}, acc=\d+\.\d\d%", bars), bars[-2000:]
    assert re.search(r"acc=\d+\.\d\d%, val_loss=\d\.\d{4}, val_acc=\d+\.\d\d%", bars), bars
    assert re.search(r"validate.*val_loss=\d\.\d{4}, val_acc=\d+\.\d\d%", bars), bars


def test_train_accuracy_is_the_steps_first_forward_and_says_when_nothing_was_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(review of issue 37) LBFGS evaluates the model several times per step: the count is
    its first evaluation's, on the weights the reported loss is of; a train_step that never
    calls forward_backward counts nothing: NaN, said once."""
    import glassloop

    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 2, (32,))
    model = nn.Linear(6, 2)
    before = int((model(x).argmax(-1) == y).sum())
    trainer = glassloop.Trainer(model, torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5),
                                nn.CrossEntropyLoss(), progress="none",
                                train_accuracy=True)  # fmt: skip
    trainer.fit([(x, y)], epochs=1)
    assert trainer.history[0]["train_accuracy"] == before / 32
    assert before / 32 != float((model(x).argmax(-1) == y).float().mean())  # (it moved)

    class OwnStep(glassloop.Trainer):
        def train_step(self, window: Any) -> Any:
            (((inputs,), _), target), *_ = window
            loss = nn.functional.cross_entropy(self.model(inputs), target)
            loss.backward()
            self.step(self.optimizer, loss.detach())
            return loss.detach()

    other = nn.Linear(6, 2)
    OwnStep(other, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss(),
            progress="lines", train_accuracy=True).fit([(x, y)] * 3, epochs=2)  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("warning: train_accuracy: no training label was counted this epoch") == 1
    assert "train_accuracy nan%" in out
