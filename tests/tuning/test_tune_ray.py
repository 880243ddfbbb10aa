"""glassloop tune --backend ray on a local Ray cluster on 127.0.0.1, reached by its address:
each trial a glassloop run in a Ray worker; the worker of the first trial SIGKILLed mid-run is
started again by Ray and resumes from the checkpoint Ray persisted (its weights those of a
straight run of its config.json, bit for bit, each epoch row once); ASHA stops the trials
that fall behind (run.json says pruned); ``glassloop runs DIR`` lists the trials."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import run_glassloop

pytestmark = pytest.mark.xdist_group("test_ray_train")  # (never beside the other Ray cluster)

BASE = """
[data]
name = "synthetic"
num_samples = 4096
num_features = 4
batch_size = 16
[model]
hidden = [32]
[train]
epochs = 4
progress = "none"
"""
SPACE = """
pruner = "asha"
[space]
"optim.lr" = { low = 1e-4, high = 1e-1, log = true }
"model.hidden" = { choices = [[32], [16, 16]] }
"""


@pytest.fixture
def cluster(ray_cluster: str) -> dict[str, str]:
    """The environment of a process that reaches the module's Ray cluster, one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ray_cluster}


def ray_workers() -> list[int]:
    """The processes of Ray's function-trial actors (their command line: ``ray::ImplicitFunc``)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as command:
                if entry.isdigit() and command.read().startswith(b"ray::ImplicitFunc"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def epochs_written(run: Path) -> list[int]:
    if not (run / "metrics.jsonl").is_file():
        return []
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["epoch"] for row in rows if row["kind"] == "epoch"]


def test_ray_backend_resumes_a_killed_trial_worker_and_prunes_with_asha(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "base.toml").write_text(BASE, encoding="utf-8")
    (tmp_path / "space.toml").write_text(SPACE, encoding="utf-8")
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "glassloop", "tune", "base.toml", "--space", "space.toml",
               "--trials", "2", "--sweep-dir", "sweep", "--backend", "ray"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, env=cluster, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while epochs_written(sweep / "trial-0000") != [1, 2]:  # (then mid-epoch 3)
            assert proc.poll() is None and time.monotonic() < deadline, "trial 0's epoch 2"
            time.sleep(0.02)
        [worker] = ray_workers()
        os.kill(worker, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    # Ray started the trial again, which resumed from the checkpoint in Ray's storage
    storage = re.escape(str(sweep.resolve() / "ray" / "trial-0000"))
    assert re.search(rf"resumed from '{storage}/checkpoint_\d+", out), out[-4000:]
    assert epochs_written(sweep / "trial-0000") == [1, 2, 3, 4]
    straight = run_glassloop_in(cluster, tmp_path, "train", "sweep/trial-0000/config.json",
                                "--run-dir", "straight")  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]
    weights = (sweep / "trial-0000" / "model.safetensors").read_bytes()
    assert weights == (tmp_path / "straight" / "model.safetensors").read_bytes()
    # ASHA stopped the trials below its rung; the listing says so, with each trial's values
    listed = run_glassloop("runs", str(sweep)).stdout.splitlines()
    assert listed[0].split() == ["trial", "status", "epoch", "val_loss", "params"]
    statuses = [line.split()[1] for line in listed[1:]]
    assert statuses == ["finished", "pruned"], listed
    assert all("optim.lr=" in line and "model.hidden=[" in line for line in listed[1:])
    best = re.search(r"best trial: (\d+), val_loss ", out)
    assert best and f"its config: sweep/trial-{int(best[1]):04d}/config.json" in out


def run_glassloop_in(
    env: dict[str, str], cwd: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """The command in a new process with one thread, as Ray's workers train."""
    return subprocess.run([sys.executable, "-m", "glassloop", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
