"""Evaluation numbers equal a hand computation and scikit-learn's report."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import classification_report, confusion_matrix
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import DataError, evaluate, format_report, predict
from glassloop.evaluation.metrics import RegressionSums
from glassloop.evaluation.metrics import classification_report as classification_report_of


def skewed_problem() -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    x = torch.randn(203, 6)  # 203: the last batch of 32 is short (11 samples)
    y = torch.cat(
        [torch.zeros(120, dtype=torch.long), torch.randint(0, 4, (83,))]
    )  # class 4 absent
    return model, TensorDataset(x, y)


def test_loss_accuracy_and_report_match_hand_and_sklearn() -> None:
    model, data = skewed_problem()
    dl = DataLoader(data, batch_size=32)
    result = evaluate(model, dl, nn.CrossEntropyLoss(), device=torch.device("cpu"))

    x, y = data.tensors
    with torch.no_grad():
        logits = model(x)
    per_sample = nn.functional.cross_entropy(logits, y, reduction="none")
    pred = logits.argmax(1)
    assert result["loss"] == pytest.approx(per_sample.double().mean().item(), abs=1e-6)
    assert result["accuracy"] == (pred == y).sum().item() / len(y)  # exact
    assert result["confusion"] == confusion_matrix(y, pred, labels=range(5)).tolist()

    expected = classification_report(y, pred, labels=range(5), output_dict=True, zero_division=0)
    for key, row in result["report"].items():
        for metric, value in row.items():
            assert value == expected[key][metric], (key, metric)  # to the last bit


def test_mean_over_samples_differs_from_mean_of_batch_means() -> None:
    model, data = skewed_problem()
    dl = DataLoader(data, batch_size=32)
    loss_fn = nn.CrossEntropyLoss()
    result = evaluate(model, dl, loss_fn)
    with torch.no_grad():
        batch_means = [loss_fn(model(x), y).item() for x, y in dl]
    tutorial_style = sum(batch_means) / len(batch_means)
    assert not math.isclose(result["loss"], tutorial_style, abs_tol=1e-6)


def test_evaluate_uses_eval_mode_no_grad_and_restores_mode() -> None:
    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.training, torch.is_grad_enabled()))
            return self.lin(x)

    model = Probe().train()
    evaluate(model, [(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))], nn.CrossEntropyLoss())
    assert seen == [(False, False)]
    assert model.training


def test_labels_out_of_range_in_evaluation_is_a_clear_error() -> None:
    model = nn.Linear(3, 2)
    batch = (torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]))
    with pytest.raises(DataError, match=r"outside \[0, 2\)"):
        evaluate(model, [batch], lambda out, y: out.sum() * 0)


def test_empty_evaluation_set_is_an_error() -> None:
    with pytest.raises(DataError, match="empty"):
        evaluate(nn.Linear(3, 2), [], nn.CrossEntropyLoss())


def test_predict_returns_softmax_in_inference_mode() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(10, 4)
    probs = predict(model, x, batch_size=3)
    assert torch.allclose(probs, torch.softmax(model(x), dim=1).detach())
    # The same batches from a loader (its targets dropped): the same bits. (Other batch
    # sizes may round differently: MKL picks kernels by shape, e.g. on AVX-512.)
    dl = DataLoader(TensorDataset(x, torch.zeros(10, dtype=torch.long)), batch_size=3)
    assert torch.equal(predict(model, dl), probs)


def test_format_report_lists_every_class_with_names() -> None:
    model, data = skewed_problem()
    result = evaluate(model, DataLoader(data, batch_size=50), nn.CrossEntropyLoss())
    text = format_report(result["report"], result["accuracy"], ["a", "b", "c", "d", "e"])
    assert [line.split()[0] for line in text.splitlines()[2:7]] == ["a", "b", "c", "d", "e"]
    assert "weighted avg" in text


@pytest.mark.parametrize("centre", [0.0, 1e6, 1e8])
def test_r2_is_exact_for_targets_far_from_zero(centre: float) -> None:
    """One-pass sums gave 0.910511 for scikit-learn's 0.910623 around 1e6, and 0.977 vs
    0.910 around 1e8: the sums are kept around the first batch's mean now."""
    from sklearn.metrics import r2_score

    g = torch.Generator().manual_seed(0)
    y = centre + torch.randn(400, 1, generator=g, dtype=torch.float64)
    p = y + 0.3 * torch.randn(400, 1, generator=g, dtype=torch.float64)
    sums = RegressionSums(1, torch.device("cpu"))
    for i in range(0, 400, 64):
        sums.update(p[i : i + 64], y[i : i + 64])
    assert sums.compute()["r2"] == pytest.approx(r2_score(y.numpy(), p.numpy()), rel=1e-9)


def test_the_report_equals_sklearn_to_the_last_bit_on_many_shapes() -> None:
    rng = torch.Generator().manual_seed(0)
    for classes in (2, 3, 7, 11, 30):
        y = torch.randint(0, classes, (997,), generator=rng)
        pred = torch.where(
            torch.rand(997, generator=rng) < 0.6,
            y,
            torch.randint(0, classes, (997,), generator=rng),
        )
        cm = torch.tensor(confusion_matrix(y, pred, labels=range(classes)))
        ours = classification_report_of(cm)
        expected = classification_report(
            y, pred, labels=range(classes), output_dict=True, zero_division=0
        )
        for key, row in ours.items():
            assert row == {k: expected[key][k] for k in row}, (classes, key)


def test_predict_takes_a_tuple_of_inputs_for_a_model_with_several() -> None:
    """predict((a, b)) is a two-input dataset, one example per row (split into batches like
    a tensor); inputs of different lengths are one line that says how to pass one batch."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(z)

    model = Two()
    a, b = torch.randn(10, 3), torch.randn(10, 4)
    probs = predict(model, (a, b), batch_size=4)
    assert torch.allclose(probs, torch.softmax(model(a, b), dim=-1))
    with pytest.raises(DataError, match=r"for one batch pass \[\(a, b\)\]"):
        predict(model, (a, b[:5]))
