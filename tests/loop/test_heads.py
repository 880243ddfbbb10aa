"""A model with several heads, a task each: every head's metrics without an ``evaluate``
override (each equal to the hand computation on its own part of the target), and ``predict``
returning every head as the model returns them (a dict, or a tuple)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from glassloop import ConfigError, Trainer
from glassloop.errors import ModelError

HEADS = {"kind": "classification", "size": "regression"}


class TwoHeads(nn.Module):
    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple
        self.body, self.kind, self.size = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.body(x))
        kind, size = self.kind(h), self.size(h)
        return (kind, size) if self.as_tuple else {"kind": kind, "size": size}


def joint_loss(out: Any, target: Any) -> torch.Tensor:
    kind, size = (out["kind"], out["size"]) if isinstance(out, dict) else out
    y_kind, y_size = (target["kind"], target["size"]) if isinstance(target, dict) else target
    return F.cross_entropy(kind, y_kind) + F.mse_loss(size, y_size)


def data(n: int, seed: int, as_tuple: bool = False) -> list[tuple[torch.Tensor, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    kind = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    size = (2 * x[:, 2:3]).float()
    batches = []
    for i in range(0, n, 25):
        part = (kind[i : i + 25], size[i : i + 25])
        target = part if as_tuple else {"kind": part[0], "size": part[1]}
        batches.append((x[i : i + 25], target))
    return batches


def make(as_tuple: bool = False) -> Trainer:
    torch.manual_seed(0)
    model = TwoHeads(as_tuple)
    return Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), joint_loss,
                   task=HEADS, device="cpu", progress="none")  # fmt: skip


@pytest.mark.parametrize("as_tuple", [False, True], ids=["dict", "tuple"])
def test_every_head_has_its_task_metrics_equal_to_the_hand_computation(as_tuple: bool) -> None:
    trainer = make(as_tuple)
    val = data(100, 1, as_tuple)
    row = trainer.fit(data(200, 0, as_tuple), val, epochs=2)[-1]
    model = trainer.model.eval()
    with torch.no_grad():
        outs = [model(x) for x, _ in val]
    kinds = torch.cat([o[0] if as_tuple else o["kind"] for o in outs])
    sizes = torch.cat([o[1] if as_tuple else o["size"] for o in outs]).double()
    y_kind = torch.cat([t[0] if as_tuple else t["kind"] for _, t in val])
    y_size = torch.cat([t[1] if as_tuple else t["size"] for _, t in val]).double()
    assert row["val_kind_accuracy"] == pytest.approx(
        float((kinds.argmax(1) == y_kind).double().mean()), abs=1e-12
    )
    assert row["val_size_mae"] == pytest.approx(float((sizes - y_size).abs().mean()), rel=1e-6)
    rmse = float(((sizes - y_size) ** 2).mean().sqrt())
    assert row["val_size_rmse"] == pytest.approx(rmse, rel=1e-6)
    losses = [float(joint_loss(o, t)) * len(x) for o, (x, t) in zip(outs, val, strict=True)]
    assert row["val_loss"] == pytest.approx(sum(losses) / 100, rel=1e-6)
    assert "val_accuracy" not in row  # (the model's own task is the joint loss: no guess)


def test_predict_returns_every_head_as_the_model_returns_them() -> None:
    for as_tuple in (False, True):
        trainer = make(as_tuple)
        trainer.fit(data(100, 0, as_tuple), epochs=1)
        x = torch.randn(30, 6)
        predicted = trainer.predict(x, batch_size=8)
        with torch.no_grad():
            out = trainer.model.eval()(x)
        kind, size = (out[0], out[1]) if as_tuple else (out["kind"], out["size"])
        if as_tuple:
            assert isinstance(predicted, tuple) and len(predicted) == 2
            p_kind, p_size = predicted
        else:
            assert isinstance(predicted, dict) and list(predicted) == ["kind", "size"]
            p_kind, p_size = predicted["kind"], predicted["size"]
        assert torch.allclose(p_kind, torch.softmax(kind, 1), atol=1e-6)  # a class: probabilities
        assert torch.allclose(p_size, size, atol=1e-6)  # a number: as it is


def test_a_head_without_a_stated_task_or_missing_from_the_output_is_one_line() -> None:
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="head 'size' needs one of"):
        Trainer(model, optimizer, joint_loss, task={"kind": "classification", "size": "auto"})
    trainer = Trainer(model, optimizer, joint_loss, task={"kind": "classification", "age": "regression"},
                      device="cpu", progress="none")  # fmt: skip
    with pytest.raises(ModelError, match="no head 'age' in a dict"):
        trainer.predict(torch.randn(4, 6))
    with pytest.raises(ConfigError, match="with a task per head, each head gets its task's"):
        Trainer(model, optimizer, joint_loss, task=HEADS, metrics={"extra": object()})  # type: ignore[dict-item]


def test_the_report_has_each_classifying_heads_confusion_matrix_and_class_report(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), joint_loss,
                      task=HEADS, device="cpu", progress="none", run_dir=tmp_path / "run")  # fmt: skip
    trainer.fit(data(100, 0), data(50, 1), epochs=1)
    report = tmp_path / "run" / "report"
    assert (report / "kind_confusion.png").stat().st_size > 0
    text = (report / "kind_classification_report.txt").read_text()
    assert text.split()[:4] == ["precision", "recall", "f1-score", "support"]
    assert "kind:" in (report / "index.html").read_text()
    assert not (report / "size_confusion.png").exists()  # a regression head has none
