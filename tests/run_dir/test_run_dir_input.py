"""A run directory is input (copied, shared, edited): nothing read from it is unbounded. A
config.json whose lists, strings or tables are too large is one line (exit 2) before any
work, for eval, report and --resume; the report draws a fixed number of per-metric plots and
names the rest, whether the keys came from a hand-edited metrics.jsonl or a callback."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runner import run_glassloop, sets
from torch import nn

from glassloop import Callback, Trainer
from glassloop.tracking.report import MAX_METRIC_PLOTS

QUICK = [
    "data.name=synthetic",
    "data.num_samples=96",
    "data.num_features=4",
    "train.epochs=1",
    "model.hidden=[4]",
    "train.progress=none",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("input") / "run"
    done = run_glassloop("train", *sets(QUICK), "--run-dir", str(run))
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        (5_000_001, "config.json' has {size:,} bytes"),  # (built that many layers, ~30 min)
        (10_001, "model.hidden holds more than 10,000 items; a config value holds at most"),
    ],
)
def test_a_config_json_too_large_is_one_line_before_any_work(
    trained: Path, tmp_path: Path, hidden: int, message: str
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    config = json.loads((run / "config.json").read_text())
    config["model"]["hidden"] = [4] * hidden
    (run / "config.json").write_text(json.dumps(config))
    message = message.format(size=(run / "config.json").stat().st_size)
    started = time.monotonic()
    for command in (
        ["eval", str(run)],
        ["report", str(run)],
        ["train", "--run-dir", str(run), "--resume"],
    ):
        done = run_glassloop(*command)
        assert done.returncode == 2, (command, done.stdout, done.stderr[-2000:])
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
        assert message in done.stderr, done.stderr
    assert time.monotonic() - started < 30


def test_a_model_too_large_to_build_is_one_line_before_it_is_built(
    trained: Path, tmp_path: Path
) -> None:
    """model.hidden = [2**20, 2**20] (4 TB of weights): eval and report compare the config's
    model with the weights file's shapes on the meta device, and training (a resume, a fresh
    run) sizes it there against this machine's memory, before anything is allocated."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    config = json.loads((run / "config.json").read_text())
    config["model"]["hidden"] = [2**20, 2**20]
    (run / "config.json").write_text(json.dumps(config))
    for command, said in (
        (["eval", str(run)], "'1.bias' has shape [4], the model expects [1048576]"),
        (["report", str(run)], "'1.bias' has shape [4], the model expects [1048576]"),
        (["train", "--run-dir", str(run), "--resume"], "GiB of weights, more than this machine's"),
        (["train", *sets([*QUICK, "model.hidden=[1048576, 1048576]"])], "4,096.1 GiB of weights"),
    ):
        done = run_glassloop(*command, cwd=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert said in done.stderr, done.stderr


def test_the_report_draws_at_most_its_plots_and_names_the_rest(
    trained: Path, tmp_path: Path
) -> None:
    """3,000 val_ keys in a hand-edited metrics.jsonl drew 1,155 plots in 300 s: now at most
    MAX_METRIC_PLOTS, the others named in index.html, in seconds."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["kind"] == "epoch":
            row.update({f"val_m{i:04d}": 0.5 for i in range(3_000)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    started = time.monotonic()
    done = run_glassloop("report", str(run))
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    drawn = sorted(p.name for p in (run / "report").glob("val_*.png"))
    assert len(drawn) == MAX_METRIC_PLOTS and drawn[0] == "val_accuracy.png", drawn
    page = (run / "report" / "index.html").read_text()
    assert f"{3_001 - MAX_METRIC_PLOTS:,} more validation metrics are not drawn" in page
    assert "val_m2999" in page


class ManyKeys(Callback):
    """Logs 500 numbers of its own each epoch (a per-class metric of a large label set)."""

    def on_epoch_end(self, trainer: Any, row: dict[str, Any]) -> None:
        row.update({f"val_class_{i}": i / 500 for i in range(500)})


def test_a_callback_that_logs_many_keys_gets_a_bounded_report_and_epoch_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        run_dir=tmp_path / "run",
        progress="lines",
        callbacks=[ManyKeys()],
    )
    trainer.fit(data, data, epochs=1)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch 1/1"))
    assert "more in metrics.jsonl)" in line and len(line) < 600, line
    assert len(list((tmp_path / "run" / "report").glob("val_*.png"))) == MAX_METRIC_PLOTS
