"""Faults while saving: kill -9 in the middle of a checkpoint write, and a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver

from glassloop.run_dir.checkpoints import read_checkpoint

CONFIG = """
[data]
name = "synthetic"
num_samples = 600
num_features = 64
batch_size = 32
[model]
hidden = [256]
[scheduler]
name = "none"
[train]
epochs = 2
progress = "none"
"""

# Runs the CLI with the file writer wrapped so that the process SIGKILLs itself once it wrote
# (and synced) one file of the step-30 checkpoint: a real kill -9, in the middle of writing a
# checkpoint directory.
KILL_DURING_WRITE = """
import os, signal, sys
import glassloop.run_dir.checkpoints as checkpoint
from glassloop.cli.main import main

real_write = checkpoint.write_digested

def write_digested(path, pieces):
    written = real_write(path, pieces)
    if path.parent.name.startswith(".tmp-step-00000030") and path.name == "state.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return written

checkpoint.write_digested = write_digested
sys.exit(main(sys.argv[1:]))
"""


def run(
    cwd: Path, *args: str, env: dict[str, str] | None = None, limit: int | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a new process (forked: torch is not imported again); ``limit``: the
    largest file it may write (a full disk, as the kernel reports it: EFBIG on write)."""
    return forkserver.run(
        [sys.executable, *args],
        cwd=cwd,
        timeout=300,
        env={**os.environ, **(env or {})},
        fsize_limit=limit,
    )


def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    (tmp_path / "cfg.toml").write_text(CONFIG)
    (tmp_path / "kill.py").write_text(KILL_DURING_WRITE)
    # Each checkpoint fsyncs 5 files; the 7th fsync is inside the second checkpoint.
    killed = run(
        tmp_path, "kill.py", "train", "cfg.toml", "--run-dir", "r", env={"KILL_AT_FSYNC": "7"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    root = tmp_path / "r" / "checkpoints"
    assert (root / "latest").read_text() == "step-00000015\n"
    assert read_checkpoint(root / "step-00000015").step == 15  # intact and verified
    assert any(p.name.startswith(".tmp-") for p in root.iterdir())  # the cut write's leftovers
    resumed = run(tmp_path, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "r", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # cleaned at start
    assert (root / "latest").read_text() == "step-00000030\n"


def test_disk_full_keeps_every_earlier_checkpoint_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "cfg.toml").write_text(CONFIG.replace("epochs = 2", "epochs = 1"))
    first = run(tmp_path, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "r")
    assert first.returncode == 0, first.stderr
    good = tmp_path / "r" / "checkpoints" / "step-00000015"
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    weights = (good / "model.safetensors").stat().st_size
    # Files may grow to half the weights file: metrics and JSON fit, a checkpoint does not.
    full = run(
        tmp_path,
        "-m",
        "glassloop",
        "train",
        "cfg.toml",
        "--run-dir",
        "r",
        "--resume",
        "--set",
        "train.epochs=2",
        limit=weights // 2,
    )
    assert full.returncode == 3, full.stderr
    line = full.stderr.strip().splitlines()[-1]
    assert "could not write" in line and "step-00000030" in line
    assert "File too large (EFBIG)" in line
    assert "nothing was lost, last good checkpoint: r/checkpoints/step-00000015" in line
    root = tmp_path / "r" / "checkpoints"
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert read_checkpoint(good).step == 15
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "failed"


def test_a_metrics_file_that_cannot_grow_is_exit_3_in_one_line_and_run_json_says_failed(
    tmp_path: Path,
) -> None:
    """The right one-line error was raised, then closing the metrics file flushed the same
    rows again and an OSError traceback escaped (exit 1), run.json still "running"."""
    small = CONFIG.replace("num_features = 64", "num_features = 4").replace("[256]", "[2]")
    small = small.replace("batch_size = 32", "batch_size = 8") + "log_every = 1\n"
    (tmp_path / "cfg.toml").write_text(small)
    # Files may grow to 6,000 bytes: config.json and run.json fit, metrics.jsonl does not.
    done = run(tmp_path, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "r", limit=6000)
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "could not write 'r/metrics.jsonl': File too large (EFBIG)" in lines[0]
    assert "the checkpoints written so far are intact" in lines[0]
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "failed" and "metrics.jsonl" in info["error"]
