"""Every task from the command line: train, eval, predict, report, doctor, export and reload
for a regression (scikit-learn's diabetes set as CSV) and a multi-label tagger (npz); and the
target mistakes that used to train silently wrong."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop, sets
from regression_data import REGRESSION, diabetes_csv
from sklearn.datasets import load_diabetes

import glassloop


def test_regression_from_csv_trains_evaluates_predicts_and_reports(tmp_path: Path) -> None:
    table = diabetes_csv(tmp_path / "diabetes.csv")
    run = tmp_path / "run"
    train = run_glassloop(
        "train", *sets([f"data.path={table}", *REGRESSION]), "--run-dir", str(run)
    )
    assert train.returncode == 0, train.stderr + train.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["kind"] == "epoch"][-1]
    assert {"val_mae", "val_rmse", "val_r2", "val_explained_variance"} <= last.keys()
    assert last["val_r2"] > 0.2  # it learned something (a mean predictor scores 0)
    assert (run / "report" / "predicted_vs_true.png").is_file()
    assert (run / "report" / "val_r2.png").is_file()
    assert not (run / "report" / "confusion.png").exists()

    evaluated = run_glassloop("eval", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert "task: regression" in evaluated.stdout
    assert f"r2: {last['val_r2']:.6g}" in evaluated.stdout

    features = tmp_path / "new.csv"
    with table.open() as handle:
        lines = handle.read().splitlines()
    header = lines[0].split(",")[:-1]
    features.write_text(
        "\n".join([",".join(header), *(",".join(line.split(",")[:-1]) for line in lines[1:4])])
        + "\n"
    )
    predicted = run_glassloop(
        "predict", str(run), str(features), "--output", str(tmp_path / "p.csv")
    )
    assert predicted.returncode == 0, predicted.stderr
    first = predicted.stdout.splitlines()[0]
    assert first.startswith("new.csv:2: progression ") and "%" not in first
    value = float(first.split()[-1])
    model = glassloop.load_model(run)
    assert model is not None
    with (tmp_path / "p.csv").open() as handle:
        assert next(csv.reader(handle)) == ["input", "rank", "output", "value"]
    assert abs(value) < 10

    doctor = run_glassloop(
        "doctor", *sets([f"data.path={table}", *REGRESSION]), "--output", str(tmp_path / "doc")
    )
    assert doctor.returncode == 0, doctor.stderr + doctor.stdout
    assert "initial loss" not in doctor.stdout and "labels" not in doctor.stdout.split("\n")[0]
    assert "overfit one batch" in doctor.stdout


def test_regression_targets_far_from_zero_are_named_and_can_be_standardised(
    tmp_path: Path,
) -> None:
    """Targets in their own units (mean 152, std 77): nothing said so, defaults gave a poor
    val_r2 and doctor blamed "model/loss/labels". Now a warning names the scale, doctor has a
    "target scale" check, and data.standardize_targets learns them standardised while every
    reported and predicted number stays in the targets' units."""
    data = load_diabetes()
    table = tmp_path / "diabetes.csv"
    rows = [",".join([*data.feature_names, "progression"])]
    rows += [
        ",".join([*(repr(float(v)) for v in x), repr(float(t))])
        for x, t in zip(data.data, data.target, strict=True)
    ]
    table.write_text("\n".join(rows) + "\n")
    settings = ["data.name=csv", f"data.path={table}", "data.label_column=progression",
                "loss.name=mse", "train.epochs=6", "train.progress=none"]  # fmt: skip
    plain = run_glassloop("train", "--run-dir", str(tmp_path / "plain"), *sets(settings))
    assert plain.returncode == 0, plain.stderr
    said = plain.stdout + plain.stderr
    assert "regression targets have mean 151.6 and std 78.3" in said
    scaled = run_glassloop("train", "--run-dir", str(tmp_path / "scaled"),
                           *sets([*settings, "data.standardize_targets=true"]))  # fmt: skip
    assert scaled.returncode == 0, scaled.stderr
    assert "regression targets have mean" not in scaled.stdout + scaled.stderr

    def last(run: str) -> dict[str, float]:
        return json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[-1])

    assert last("scaled")["val_r2"] > 0.2 > last("plain")["val_r2"]
    # In the targets' units: the reported MAE, and predictions on raw CSV rows.
    model = glassloop.load_model(tmp_path / "scaled")
    predictor = glassloop.Predictor.from_path(tmp_path / "scaled")
    _, values = predictor.predict_files([table])
    assert 100 < float(values.mean()) < 200
    assert 30 < last("scaled")["val_mae"] < 80
    spec = predictor.spec["preprocessing"]
    raw = torch.tensor(data.data[:5], dtype=torch.float32)
    inputs = (raw - torch.tensor(spec["mean"])) / torch.tensor(spec["std"])
    assert torch.allclose(values[:5], glassloop.predict(model, inputs), rtol=1e-5)
    doctor = run_glassloop("doctor", *sets(settings))
    assert "WARN  target scale" in doctor.stdout and "standardize_targets" in doctor.stdout
    fixed = run_glassloop("doctor", *sets([*settings, "data.standardize_targets=true"]))
    assert "PASS  target scale" in fixed.stdout
    wrong = run_glassloop("train", *sets(["data.name=synthetic", "data.standardize_targets=true"]))
    assert wrong.returncode == 2 and "data.standardize_targets is for a regression" in wrong.stderr


def test_multilabel_from_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 6)).astype(np.float32)
    y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] < -0.5], axis=1).astype(np.float32)
    np.savez(tmp_path / "tags.npz", x=x, y=y)
    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--run-dir", str(run),
        *sets([f"data.path={tmp_path / 'tags.npz'}", "data.name=npz", "loss.name=bce_with_logits",
               "loss.pos_weight=[1.0, 1.0, 2.0]", "train.epochs=8", "model.hidden=[32]", "optim.lr=0.02",
               "train.progress=none", "train.metrics=['auroc']"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_exact_match"] > 0.6 and last["val_auroc"] > 0.9
    np.save(tmp_path / "two.npy", x[:2])
    predicted = run_glassloop("predict", str(run), str(tmp_path / "two.npy"))
    assert predicted.returncode == 0, predicted.stderr
    assert predicted.stdout.splitlines()[0].count("%") == 3  # every label's probability


def test_real_valued_targets_are_never_read_as_classes(tmp_path: Path) -> None:
    table = diabetes_csv(tmp_path / "d.csv")
    done = run_glassloop(
        "train", *sets([f"data.path={table}", "data.name=csv", "data.label_column=progression"])
    )
    assert done.returncode == 2
    assert "holds real numbers" in done.stderr and "loss.name = 'mse'" in done.stderr
    np.savez(tmp_path / "f.npz", x=np.zeros((20, 3), np.float32), y=np.linspace(0, 1, 20))
    done = run_glassloop("train", *sets([f"data.path={tmp_path / 'f.npz'}", "data.name=npz"]))
    assert done.returncode == 2
    assert "must be integers (class indices)" in done.stderr


def test_the_task_alone_trains_with_its_loss(tmp_path: Path) -> None:
    """What the float-target error advises, ``train.task = 'regression'`` without a
    loss.name, trains the regression's loss (mse): every metric row equals the run that
    names loss.name = 'mse' (it trained a cross-entropy over one column: 0.0 at every step)."""
    table = diabetes_csv(tmp_path / "d.csv")
    common = [
        f"data.path={table}",
        "data.name=csv",
        "data.label_column=progression",
        "train.epochs=1",
        "train.progress=none",
        "model.hidden=[8]",
    ]
    rows = {}
    for name, extra in (("task", ["train.task=regression"]), ("loss", ["loss.name=mse"])):
        done = run_glassloop("train", *sets([*common, *extra]), "--run-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        timeless = (
            {k: v for k, v in json.loads(line).items() if not k.endswith(("_s", "seconds"))}
            for line in lines
        )
        rows[name] = list(timeless)
    epoch = [r for r in rows["task"] if r["kind"] == "epoch"][-1]
    assert epoch["train_loss"] > 0.1 and "val_r2" in epoch
    assert rows["task"] == rows["loss"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["loss.name=mse", "data.name=digits"], "a regression task reads its targets from"),
        (["loss.name=hinge"], "loss.name must be one of"),
        (["checkpoint.monitor=r2"], "must be 'train_loss' or a validation metric"),
        (["train.metrics=['r2']"], "no metric 'r2' for a classification task"),
        (
            ["train.task=regression", "loss.name=cross_entropy"],
            "config: loss.name 'cross_entropy' is a classification loss, but train.task is "
            "'regression': drop loss.name (a regression trains with 'mse') or give one of mse, "
            "l1, huber, smooth_l1",
        ),
        (["train.task=multilabel", "loss.name=mse"], "is a regression loss, but train.task"),
        (["train.task=classification", "loss.name=bce_with_logits"], "is a multilabel loss"),
    ],
)
def test_task_settings_are_checked(settings: list[str], message: str) -> None:
    done = run_glassloop("train", *sets(settings))
    assert done.returncode == 2
    assert message in done.stderr


def test_model_target_gets_the_data_shape_when_it_asks(tmp_path: Path) -> None:
    (tmp_path / "net.py").write_text(
        "import math\n"
        "from torch import nn\n"
        "class Net(nn.Sequential):\n"
        "    def __init__(self, input_shape, num_classes, width=16):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(math.prod(input_shape), width),\n"
        "                         nn.ReLU(), nn.Linear(width, num_classes))\n"
    )  # fmt: skip
    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--run-dir", str(run),
        *sets([f"model.target={tmp_path / 'net.py'}:Net", "model.kwargs={width = 8}",
               "data.name=digits", "train.epochs=1", "train.progress=none"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    weights = glassloop.load_model(run, trust_code=True)
    assert weights[1].in_features == 64 and weights[3].out_features == 10
    assert isinstance(weights[1].weight, torch.Tensor) and weights[1].out_features == 8


def test_language_model_from_npz_token_windows(tmp_path: Path) -> None:
    """Token ids in, next tokens out (padding -100): a model.target LM from the command line,
    evaluated with perplexity and asked for the next token."""
    (tmp_path / "lm.py").write_text(
        "from torch import nn\n"
        "class LM(nn.Module):\n"
        "    def __init__(self, num_classes, width=32):\n"
        "        super().__init__()\n"
        "        self.embed = nn.Embedding(num_classes, width)\n"
        "        self.rnn = nn.GRU(width, width, batch_first=True)\n"
        "        self.head = nn.Linear(width, num_classes)\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.rnn(self.embed(tokens))[0]).transpose(1, 2)  # (N, C, T)\n"
    )  # fmt: skip
    start = np.random.default_rng(0).integers(0, 12, size=(300, 1))
    seq = (start + np.arange(11)) % 12
    y = seq[:, 1:].copy()
    y[::4, -2:] = -100
    np.savez(tmp_path / "tokens.npz", x=seq[:, :-1], y=y)
    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--run-dir", str(run),
        *sets([f"data.path={tmp_path / 'tokens.npz'}", "data.name=npz",
               f"model.target={tmp_path / 'lm.py'}:LM", "train.task=language-model",
               "train.epochs=6", "optim.lr=0.01", "train.progress=none"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_accuracy"] > 0.9 and last["val_perplexity"] < 2.0
    np.save(tmp_path / "prompt.npy", np.array([[3, 4, 5, 6]]))
    predicted = run_glassloop("predict", str(run), str(tmp_path / "prompt.npy"), "--trust-code")
    assert predicted.returncode == 0, predicted.stderr
    assert predicted.stdout.startswith("prompt.npy[0]: 7 ")  # the next token after 3, 4, 5, 6


def test_quick_checks_and_the_resolved_config(tmp_path: Path) -> None:
    fast = run_glassloop("train", "--fast-dev-run", *sets(["data.name=digits"]), cwd=tmp_path)
    assert fast.returncode == 0, fast.stderr + fast.stdout
    assert "; 1 step per epoch, 1 epoch" in fast.stdout
    assert "epoch 1/1" in fast.stdout and fast.stdout.rstrip().endswith("fast dev run: ok")
    assert not (tmp_path / "runs").exists()  # nothing written

    limited = run_glassloop(
        "train", "--limit-batches", "3", "--run-dir", str(tmp_path / "lim"),
        *sets(["data.name=digits", "train.epochs=2", "train.progress=lines"]),
    )  # fmt: skip
    assert limited.returncode == 0, limited.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "lim" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["kind"] == "epoch"] == [3, 6]

    shown = run_glassloop("config", *sets(["optim.lr=3e-4", "data.name=digits"]))
    assert shown.returncode == 0, shown.stderr
    assert "[optim]" in shown.stdout and "lr = 0.0003" in shown.stdout
    (tmp_path / "my.toml").write_text(shown.stdout)
    again = run_glassloop("config", str(tmp_path / "my.toml"))
    assert again.stdout == shown.stdout  # it reads back as the same config

    helped = run_glassloop("--help")
    assert "exit codes:" in helped.stdout and "--fast-dev-run" in helped.stdout


def test_predict_warns_about_inputs_far_from_the_training_data(tmp_path: Path) -> None:
    from glassloop.data.datasets import load_mnist_5k_arrays

    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--limit-batches", "5", "--run-dir", str(run),
        *sets(["train.epochs=1", "train.progress=none"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    images, _ = load_mnist_5k_arrays()
    digit = images[0].reshape(28, 28).astype(np.float32)
    np.save(tmp_path / "two.npy", np.stack([digit, 255 - digit]))  # the second inverted
    predicted = run_glassloop("predict", str(run), str(tmp_path / "two.npy"))
    assert predicted.returncode == 0, predicted.stderr
    warnings = [line for line in predicted.stderr.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: two.npy[1] is far from")
    assert len(predicted.stdout.splitlines()) == 2  # both still predicted


def test_a_run_made_in_python_gets_a_report_and_clear_answers(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    trainer = glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=tmp_path / "py",
    )  # fmt: skip
    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).long()
    trainer.fit([(x, y)], [(x, y)], epochs=2)
    assert (tmp_path / "py" / "report" / "index.html").is_file()  # written by fit
    (tmp_path / "py" / "report" / "index.html").unlink()
    report = run_glassloop("report", str(tmp_path / "py"))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "py" / "report" / "index.html").is_file()
    evaluated = run_glassloop("eval", str(tmp_path / "py"))
    assert evaluated.returncode == 2
    assert "was trained from Python" in evaluated.stderr and "load_weights" in evaluated.stderr
