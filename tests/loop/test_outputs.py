"""Probabilities in, probabilities out, for every way of writing the loss: a model ending in a
sigmoid (or softmax) is never put through a second one, its yes/no metrics are computed on
(N, 1) outputs against (N,) targets, and a task's metrics are never skipped silently."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import glassloop
from glassloop import Trainer
from glassloop.tracking.summary import loss_note


def pairs(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A yes/no target per row, as (N,) floats (what the Siamese example feeds BCELoss)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).float()
    return [(x[i : i + 25], y[i : i + 25]) for i in range(0, n, 25)]


def bce_of_squeezed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """pytorch/examples siamese_network: ``BCELoss()(outputs.squeeze(), targets)``, in a
    function (so the loss itself says nothing about probabilities)."""
    return nn.BCELoss()(out.squeeze(), target)


def sigmoid_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())


def trainer(model: nn.Module, loss: Any, **kwargs: Any) -> Trainer:
    return Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss,
                   device="cpu", progress="none", **kwargs)  # fmt: skip


def test_a_model_ending_in_a_sigmoid_is_predicted_once_and_its_metrics_reported() -> None:
    """Before: predict applied a second sigmoid (0.42 -> 0.60, every pair "same") and no
    metric was reported ((N, 1) outputs against (N,) targets)."""
    model = sigmoid_model()
    fitted = trainer(model, bce_of_squeezed, task="multilabel")
    val = pairs(100, 1)
    row = fitted.fit(pairs(200, 0), val, epochs=2)[-1]
    x = torch.cat([b[0] for b in val])
    y = torch.cat([b[1] for b in val])
    with torch.no_grad():
        out = model.eval()(x)
    assert torch.equal(fitted.predict(x), out)  # as the model returns them: no second sigmoid
    assert torch.equal(glassloop.predict(model, x, task="multilabel"), out)
    hand = float(((out.squeeze(1) > 0.5).float() == y).double().mean())  # decided at 0.5
    assert row["val_accuracy"] == pytest.approx(hand, abs=1e-12)
    assert row["val_exact_match"] == pytest.approx(hand, abs=1e-12)


def test_a_model_ending_in_a_softmax_gets_no_second_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(glassloop.predict(model, x), model(x))
    logits = nn.Linear(4, 3)  # (and a plain model still gets its softmax)
    with torch.no_grad():
        assert torch.allclose(glassloop.predict(logits, x), torch.softmax(logits(x), 1))


def test_a_custom_loss_with_task_auto_predicts_the_outputs_as_they_are_and_says_so() -> None:
    """The VAE's 784 output pixels were softmaxed by predict: its loss (a function of its
    own) says nothing about the outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Sigmoid(), nn.Linear(6, 6))

    def reconstruction(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction="sum")

    data = [(x, x.repeat(1, 2)[:, :6]) for x, _ in pairs(50, 0)]
    fitted = trainer(model, reconstruction, loss_reduction="sum")
    fitted.fit(data, epochs=1)
    x = torch.randn(7, 4)
    with pytest.warns(UserWarning, match=r"predict: the loss implies no task .* as they are"):
        predicted = fitted.predict(x)
    with torch.no_grad():
        assert torch.equal(predicted, model.eval()(x))


def test_a_tasks_metrics_skipped_for_their_shape_are_said() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    val = [(x, torch.zeros(len(x), 2)) for x, _ in pairs(50, 1)]  # 3 outputs, 2 labels
    with pytest.warns(UserWarning, match=r"no multilabel metrics: the outputs are shaped"):
        result = glassloop.evaluate(model, val, lambda out, t: out.sum() * 0, task="multilabel")
    assert set(result) == {"loss"}


def test_the_start_header_knows_torchs_own_loss_functions_reduction() -> None:
    assert loss_note(F.nll_loss, "mean") is None  # (its reduction is torch's: a mean)
    assert loss_note(F.cross_entropy, "mean") is None
    note = loss_note(bce_of_squeezed, "mean")
    assert note is not None and "pass loss_reduction='sum'" in note
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a plain classifier: nothing to say)
        glassloop.evaluate(nn.Linear(4, 2), [(torch.zeros(2, 4), torch.tensor([0, 1]))], F.nll_loss)


class SigmoidInForward(nn.Module):
    """Ends in ``torch.sigmoid`` in its forward: nothing to see from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x))


def test_outputs_says_what_the_model_returns_when_nothing_shows_it() -> None:
    torch.manual_seed(0)
    model = SigmoidInForward()
    said = trainer(model, bce_of_squeezed, task="multilabel", outputs="probabilities")
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = model(x)
    assert torch.equal(said.predict(x), out)
    guessed = trainer(model, bce_of_squeezed, task="multilabel")  # (auto: taken as logits)
    assert torch.allclose(guessed.predict(x), torch.sigmoid(out))
    logits = trainer(sigmoid_model(), nn.BCEWithLogitsLoss(), task="multilabel", outputs="logits")
    assert not logits.probabilities  # (said: logits, whatever the last module)
    with pytest.raises(glassloop.ConfigError, match="outputs must be one of auto, logits"):
        trainer(model, bce_of_squeezed, outputs="probability")


def test_train_outputs_in_a_config_reaches_the_trainer() -> None:
    from glassloop.config.schema import load_config

    base = ["data.name=synthetic", "model.hidden=[8]", "train.progress=none"]
    run = glassloop.build(load_config(None, [*base, "train.outputs=probabilities"]))
    assert run.trainer.probabilities
    with pytest.raises(glassloop.ConfigError, match=r"train\.outputs"):
        load_config(None, [*base, "train.outputs=probability"])


class SoftmaxInForward(nn.Module):
    """Ends in ``torch.softmax`` in its forward, trained with a loss of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x), dim=1)


def nll_of_probabilities(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(torch.log(out), target)


@pytest.mark.parametrize(
    ("model", "loss", "task", "looks"),
    [
        (SigmoidInForward, bce_of_squeezed, "multilabel", "a sigmoid's"),
        (SoftmaxInForward, nll_of_probabilities, "classification", "a softmax's"),
    ],
)
def test_probabilities_from_a_function_in_forward_are_said_once(
    model: type[nn.Module], loss: Any, task: str, looks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``torch.sigmoid(...)`` (or softmax) written in forward, under a loss of the user's: the
    outputs were read as logits without a word (val_accuracy 0.4375 where the hand count is
    0.875; predict applied a second sigmoid). One warning names outputs='probabilities', and
    with it set the accuracy is the hand count and nothing is said."""
    torch.manual_seed(0)
    data = pairs(100, 0)
    if task == "classification":  # (three classes)
        data = [(x, (y + x[:, 2].gt(1)).long()) for x, y in data]
    with pytest.warns(
        glassloop.errors.GlassloopWarning, match=f"look like {looks}"
    ):  # (filters too)
        trainer(model(), loss, task=task).fit(data, epochs=1)
    said = capsys.readouterr()
    warned = [line for line in (said.out + said.err).splitlines() if "'probabilities'" in line]
    assert len(warned) == 1 and f"look like {looks}" in warned[0], said  # (and once: not twice)
    torch.manual_seed(0)
    right = trainer(model(), loss, task=task, outputs="probabilities")
    row = right.fit(data, data, epochs=1)[-1]
    assert "'probabilities'" not in "".join(capsys.readouterr())
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    with torch.no_grad():
        out = right.model.eval()(x)
    hand = (out.squeeze(1) > 0.5).float() == y if task == "multilabel" else out.argmax(1) == y
    assert row["val_accuracy"] == pytest.approx(float(hand.double().mean()), abs=1e-12)
