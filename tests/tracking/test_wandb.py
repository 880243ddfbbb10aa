"""Experiment tracking in Weights & Biases, offline (``WANDB_MODE=offline``: no account, no
network): what glassloop logs is read back from the run files W&B writes, records in its
LevelDB-style log (``run-<id>.wandb``) decoded with W&B's own protobuf messages."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import glassloop
from glassloop.options import TrackingConfig

wandb = pytest.importorskip("wandb")  # the dev extra installs it
from wandb.proto import wandb_internal_pb2  # noqa: E402


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))  # nothing in the user's home


def records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB log records (crc32, length, type; a record may span 32 KiB blocks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def logged(run_dir: Path) -> dict[str, Any]:
    """What the offline runs in ``run_dir/wandb`` hold: run ids, config, history rows by
    step, final summary, saved files, artifacts, exit codes."""
    found: dict[str, Any] = {"ids": [], "config": {}, "history": {}, "summary": {},
                             "files": set(), "artifacts": [], "exits": []}  # fmt: skip
    for file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["ids"].append(record.run.run_id)
                found["tags"] = list(record.run.tags)
                found["name"] = record.run.display_name
                for item in record.run.config.update:
                    found["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}  # fmt: skip
                found["history"].setdefault(row["_step"], {}).update(row)
            elif kind == "summary":
                for item in record.summary.update:
                    found["summary"][item.key or "/".join(item.nested_key)] = item.value_json
            elif kind == "files":
                found["files"] |= {f.path for f in record.files.files}
            elif kind == "artifact":
                found["artifacts"].append(
                    (record.artifact.type, [c.path for c in record.artifact.manifest.contents])
                )
            elif kind == "exit":
                found["exits"].append(record.exit.exit_code)
    return found


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 0] > 0).long()
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]


def trainer(run_dir: Path, tracking: TrackingConfig) -> glassloop.Trainer:
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    return glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=run_dir, tracking=tracking, log_every=1,
    )  # fmt: skip


def test_an_offline_run_holds_params_metrics_files_weights_status_and_a_resume_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tracking = TrackingConfig(backend="wandb", experiment="tests", tags={"team": "a"})
    run = tmp_path / "run"
    trainer(run, tracking).fit(batches(), batches(), epochs=2)
    # run.finish() hands the last records to W&B's service process, which writes them on its
    # own time (read too early under load, the file once held none); teardown() ends that
    # process, so its file is complete (what a user's process exit does too).
    wandb.teardown()
    first = logged(run)
    run_id = json.loads((run / "tracking.json").read_text())["run_id"]
    assert first["ids"] == [run_id] and first["name"] == "run" and first["tags"] == ["team=a"]
    assert first["config"]["optimizer"] == "SGD" and first["config"]["task"] == "classification"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [(s, first["history"][s]["val_loss"]) for s in (3, 6)] == [
        (r["step"], r["val_loss"]) for r in epochs
    ]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [first["history"][r["step"]]["step/loss"] for r in steps] == [r["loss"] for r in steps]
    assert {"report/index.html", "report/loss.png"} <= first["files"]
    assert first["artifacts"] == [("model", ["model.safetensors"])]
    assert json.loads(first["summary"]["status"]) == "finished" and first["exits"] == [0]

    # W&B names an offline run's folder by the second it started and the run id: a resume
    # within the same second would write over the first part's folder. Wait for the next.
    [folder] = run.glob("wandb/offline-run-*")
    started = folder.name.split("-")[2]  # (offline-run-YYYYMMDD_HHMMSS-id)
    deadline = time.monotonic() + 5
    while time.strftime("%Y%m%d_%H%M%S") <= started:
        assert time.monotonic() < deadline, f"the clock's second after {started}"
        time.sleep(0.01)
    trainer(run, tracking).fit(batches(), batches(), epochs=3, resume="auto")
    wandb.teardown()
    # Offline, W&B cannot rewind: one line says which steps keep their first values.
    assert "tracking (wandb): the run goes on from step 6, but W&B keeps" in capsys.readouterr().out
    both = logged(run)
    assert both["ids"] == [run_id, run_id]  # the same W&B run, continued
    assert both["history"][9]["val_loss"] == pytest.approx(
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    )
    assert list((tmp_path).glob("wandb")) == []  # W&B's files are in the run directory


def test_a_wandb_that_cannot_start_costs_one_warning_not_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    broken = TrackingConfig(backend="wandb", uri="127.0.0.1:9")  # no scheme: W&B refuses it
    history = trainer(run, broken).fit(batches(), epochs=2)
    assert len(history) == 2 and (run / "model.safetensors").is_file()
    out = capsys.readouterr().out
    assert out.count("warning: tracking (wandb) failed and is off for the rest of this run") == 1
    assert not (run / "tracking.json").exists()


def test_a_password_in_the_tracking_uri_reaches_no_file_and_no_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracking.uri=http://user:password@host used to be written into config.json, run.json
    (the command line), every checkpoint's meta.json, the report and the tracker's params."""
    from cli_runner import run_glassloop

    secret = "Pa55-w0rd-PLANTED"
    token = "tok-PLANTED-9f8e"
    uri = f"http://ann:{secret}@localhost:9/?api_key={token}"
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    done = run_glassloop(
        "train", "--run-dir", str(run), "--set", "data.name=synthetic", "--set", "model.hidden=[8]",
        "--set", "train.epochs=1", "--set", "train.progress=none", "--set", "tracking.backend=wandb",
        "--set", f"tracking.uri={uri}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout + done.stderr and token not in done.stdout + done.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.endswith(".wandb") for p in files)  # the tracker's own store is searched
    leaks = [
        p for p in files if secret.encode() in p.read_bytes() or token.encode() in p.read_bytes()
    ]
    assert leaks == [], leaks
    config = json.loads((run / "config.json").read_text())
    assert config["tracking"]["uri"] == "http://***@localhost:9/?api_key=***"
