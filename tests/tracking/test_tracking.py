"""Experiment tracking in MLflow: against a local store and a real ``mlflow server`` on
127.0.0.1, read back with MLflow's own client; a resumed run continues its tracked run; a
server that goes away mid-run costs one warning, never the training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import glassloop
from glassloop.options import TrackingConfig

mlflow = pytest.importorskip("mlflow")  # the dev extra installs it
from mlflow.tracking import MlflowClient  # noqa: E402


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 0] > 0).long()
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]


def trainer(run_dir: Path, tracking: TrackingConfig, **options: Any) -> glassloop.Trainer:
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    return glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=run_dir, tracking=tracking, **options,
    )  # fmt: skip


def run_id(run_dir: Path) -> str:
    return str(json.loads((run_dir / "tracking.json").read_text())["run_id"])


def test_a_local_store_gets_params_metrics_artifacts_and_status_and_a_resume_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the store is one folder: nothing lands where we started
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = TrackingConfig(backend="mlflow", uri=uri, experiment="tests", tags={"team": "a"})
    run = tmp_path / "run"
    trainer(run, tracking).fit(batches(), batches(), epochs=2)
    client = MlflowClient(tracking_uri=uri)
    first = run_id(run)
    info = client.get_run(first)
    assert info.info.status == "FINISHED" and info.info.run_name == "run"
    assert info.data.tags["team"] == "a"
    assert info.data.params["optimizer"] == "SGD" and info.data.params["task"] == "classification"
    losses = client.get_metric_history(first, "val_loss")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [(m.step, m.value) for m in losses] == [(r["step"], r["val_loss"]) for r in epochs]
    assert client.get_metric_history(first, "step/loss")  # step rows, at their step
    artifacts = {a.path for a in client.list_artifacts(first)}
    assert {"model.safetensors", "report"} <= artifacts
    assert "report/index.html" in {a.path for a in client.list_artifacts(first, "report")}

    assert (tmp_path / "mlartifacts").is_dir() and list(elsewhere.iterdir()) == []

    trainer(run, tracking).fit(batches(), batches(), epochs=4, resume="auto")
    assert run_id(run) == first  # the same tracked run, continued
    assert [m.step for m in client.get_metric_history(first, "val_loss")] == [3, 6, 9, 12]
    assert client.get_run(first).info.status == "FINISHED"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``mlflow server`` on 127.0.0.1 (its own store), stopped after the test."""
    with mlflow_server(tmp_path) as started:
        yield started


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``mlflow server`` on 127.0.0.1, its store in ``folder``: (its URL, its process);
    stopped when the block ends."""
    from cli_runner import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
         "--artifacts-destination", str(folder / "server-artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(process)
                pytest.fail("mlflow server did not start")
            time.sleep(0.5)
    try:
        yield url, process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """The server and its workers (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_a_real_server_and_one_that_goes_away_mid_run(
    tmp_path: Path,
    server: tuple[str, subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, process = server
    tracking = TrackingConfig(backend="mlflow", uri=url, experiment="served")
    trainer(tmp_path / "served", tracking).fit(batches(), batches(), epochs=2)
    client = MlflowClient(tracking_uri=url)
    served = run_id(tmp_path / "served")
    assert len(client.get_metric_history(served, "val_loss")) == 2
    assert client.get_run(served).info.status == "FINISHED"
    assert "model.safetensors" in {a.path for a in client.list_artifacts(served)}

    # No retries with backoff: a dead server must not stall training for minutes.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

    class StopServer(glassloop.Callback):
        def on_epoch_end(self, trainer: glassloop.Trainer, row: dict[str, Any]) -> None:
            if row["epoch"] == 1:
                stop(process)

    run = tmp_path / "orphan"
    history = trainer(run, tracking, callbacks=[StopServer()]).fit(batches(), batches(), epochs=3)
    assert len(history) == 3  # training finished
    captured = capsys.readouterr()
    warnings = [line for line in captured.out.splitlines() if "tracking" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: tracking (mlflow) failed")
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert (run / "model.safetensors").is_file() and len(
        [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    ) >= 3


def test_the_command_line_tracks_with_a_config_section(tmp_path: Path) -> None:
    from cli_runner import run_glassloop, sets

    uri = f"sqlite:///{tmp_path / 'cli.db'}"
    done = run_glassloop(
        "train", "--run-dir", str(tmp_path / "cli"),
        *sets(["data.name=digits", "train.epochs=1", "train.progress=none",
               "tracking.backend=mlflow", f"tracking.uri={uri}", "tracking.run_name=digits-1"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id(tmp_path / "cli"))
    assert run.info.run_name == "digits-1"
    assert run.data.params["optim.lr"] == "0.001" and run.data.params["data.name"] == "digits"
    assert "val_accuracy" in run.data.metrics


@pytest.mark.parametrize(
    "uri", ["file:///{tmp}/mlruns", "foo://bar", "garbage uri", "http://127.0.0.1:9"]
)
def test_a_tracking_uri_mlflow_refuses_or_a_server_that_is_down_costs_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], uri: str
) -> None:
    """Each used to be a traceback from the tracker's constructor (exit 1, run.json left
    "running", empty metrics files), or for a server that is down ~4 minutes of MLflow's own
    retries before the warning."""
    monkeypatch.chdir(tmp_path)
    tracking = TrackingConfig(backend="mlflow", uri=uri.format(tmp=tmp_path))
    start = time.monotonic()
    history = trainer(tmp_path / "run", tracking).fit(batches(), batches(), epochs=1)
    assert len(history) == 1 and time.monotonic() - start < 30
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert len(said) == 1 and "tracking (mlflow) failed" in said[0], said
    if "127.0.0.1:9" in uri:
        assert "does not answer" in said[0]
    else:
        assert "'sqlite:///mlflow.db'" in said[0]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"


def test_after_a_kill_9_and_a_resume_each_tracked_step_ends_with_the_resumed_value(
    tmp_path: Path,
) -> None:
    """A run killed at step 7 (checkpoint at 4) logged steps 5..7 to MLflow; the resumed run
    logs them again. MLflow keeps both; the last of each step equals metrics.jsonl, as
    ``glassloop runs --tracking`` checks through MLflow's own client."""
    import sys

    import forkserver
    from cli_runner import run_glassloop, sets

    uri = f"sqlite:///{tmp_path / 'kill.db'}"
    given = sets(["data.name=synthetic", "data.num_samples=400", "data.batch_size=32",
                  "train.epochs=2", "train.progress=none", "train.log_every=1",
                  "checkpoint.every_n_steps=4", "tracking.backend=mlflow", f"tracking.uri={uri}"])  # fmt: skip
    run = tmp_path / "runs" / "killed"
    killed = forkserver.run(  # (a new process, forked: tests/forkserver.py)
        [sys.executable, "-m", "glassloop", "train", "--run-dir", str(run), *given,
         "--kill-at-step", "7"], timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    resumed = run_glassloop("train", "--run-dir", str(run), "--resume", *given)
    assert resumed.returncode == 0, resumed.stderr
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id(run), "step/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == sorted([*range(1, 21), 5, 6, 7])  # steps 5..7 twice
    checked = run_glassloop("runs", str(tmp_path / "runs"), "--tracking")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "killed: mlflow run" in checked.stdout
    assert "each step's last value equal to metrics.jsonl" in checked.stdout
    # A number changed in the run directory is a difference, named, and exit 1.
    original = (run / "metrics.jsonl").read_text()
    lines = original.splitlines()
    row = json.loads(lines[5])
    row["loss"] += 1
    lines[5] = json.dumps(row)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    differs = run_glassloop("runs", str(tmp_path / "runs"), "--tracking")
    assert differs.returncode == 1
    assert f"step/loss at step {row['step']}:" in differs.stdout
    # A last line a kill cut short is skipped, and one run's folder is checked as itself.
    (run / "metrics.jsonl").write_text(original + '{"kind": "st')
    single = run_glassloop("runs", str(run), "--tracking")
    assert single.returncode == 0 and "killed: mlflow run" in single.stdout, single.stdout
    # A store not recorded (its URI held a secret) is asked for, never made here.
    recorded = json.loads((run / "tracking.json").read_text())
    (run / "tracking.json").write_text(json.dumps({k: recorded[k] for k in ("backend", "run_id")}))
    unknown = run_glassloop("runs", str(run), "--tracking", cwd=tmp_path)
    assert unknown.returncode == 1 and "set MLFLOW_TRACKING_URI" in unknown.stdout
    assert not (tmp_path / "mlflow.db").exists()
