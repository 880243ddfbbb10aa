"""One way rows leave the loop (glassloop.tracking.sinks.Destination): every row the loop
makes reaches each destination that takes its kind, the same number of times, with the same
numbers: metrics.csv, metrics.jsonl, TensorBoard and the console; an epoch's step losses
reach metrics.jsonl alone; without a run directory the console still shows every row."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import glassloop


def fit(run_dir: Path | None, capsys: pytest.CaptureFixture[str]) -> str:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 5, generator=g)
    data = [(x[i : i + 16], (x[i : i + 16, 0] > 0).long()) for i in range(0, 96, 16)]
    model = nn.Linear(5, 2)
    trainer = glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="lines", log_every=1, validate_every_n_steps=4,
        run_dir=run_dir, tensorboard=run_dir is not None,
    )  # fmt: skip
    capsys.readouterr()
    trainer.fit(data, data[:2], epochs=2)
    return capsys.readouterr().out


def test_every_row_reaches_each_destination_of_its_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = fit(tmp_path / "run", capsys)
    jsonl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    with (tmp_path / "run" / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    kinds = {kind: [r for r in jsonl if r["kind"] == kind] for kind in ("step", "val", "epoch")}
    assert [len(kinds[k]) for k in ("step", "val", "epoch")] == [12, 3, 2]
    assert [r["kind"] for r in rows] == [r["kind"] for r in jsonl if r["kind"] != "losses"]
    assert [r["kind"] for r in jsonl].count("losses") == 2  # one per epoch, metrics.jsonl only
    # The console: the tutorial's line per step row, a line per validation, one per epoch.
    step_lines = [line for line in out.splitlines() if line.startswith("loss: ")]
    assert [float(line.split()[1]) for line in step_lines] == pytest.approx(
        [r["loss"] for r in kinds["step"]], abs=5e-7
    )
    val_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1].rstrip(":")) for line in val_lines] == [
        r["step"] for r in kinds["val"]
    ]
    assert [line for line in out.splitlines() if line.startswith("epoch ")][-1].startswith(
        "epoch 2/2"
    )
    assert sum(line.startswith("epoch ") for line in out.splitlines()) == 2
    # TensorBoard: each step row's loss at its step, each epoch row's train_loss at its epoch.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == [r["step"] for r in kinds["step"]]
    assert [e.value for e in events.Scalars("epoch/train_loss")] == pytest.approx(
        [r["train_loss"] for r in kinds["epoch"]]
    )


def test_without_a_run_directory_the_console_still_gets_every_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = fit(tmp_path / "run", capsys)
    alone = fit(None, capsys)
    shown = [
        line for line in written.splitlines() if line.startswith(("loss: ", "step ", "epoch "))
    ]
    assert len(shown) == 12 + 3 + 2
    # the same lines, numbers included, but the seconds (and checkpoint_s, a run dir's)
    strip = [line.rsplit("  ", 1)[0] if line.startswith("epoch ") else line for line in shown]
    alone_lines = [
        line for line in alone.splitlines() if line.startswith(("loss: ", "step ", "epoch "))
    ]
    assert [
        line.rsplit("  ", 1)[0] if line.startswith("epoch ") else line for line in alone_lines
    ] == strip
