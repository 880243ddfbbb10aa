"""Preempted the way schedulers do it (issue 35): SIGTERM at a random moment, SIGKILL a short
grace later, the same command line again with --resume. Real processes, real signals; the
model pauses in each forward so that a signal lands in a step, a validation (epoch-end or
mid-epoch), a wait for data or between them."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import forkserver
import pytest
from cli_runner import run_glassloop
from safetensors.torch import load_file

from glassloop.step.throughput import TIMING

PREEMPTIBLE = Path(__file__).with_name("preemptible_model.py")  # copied next to the config
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# 480 training samples / 32 = 15 steps per epoch, 3 epochs; a validation of 10 batches every
# 5 steps and at each epoch's end (about half the time is validation); a checkpoint every 7
# steps, so most stops land between two of them. Dropout, shuffling, AdamW, a per-step cosine.
CONFIG = """
[model]
target = "preemptible.py:PreemptibleMLP"
[data]
name = "synthetic"
num_samples = 800
batch_size = 32
val_fraction = 0.4
[scheduler]
interval = "step"
[train]
epochs = 3
progress = "lines"
log_every = 1
validate_every_n_steps = 5
grace_s = 3
[checkpoint]
every_n_steps = 7
"""
PAUSES = {"PAUSE_S": "0.01", "EVAL_PAUSE_S": "0.01"}
GRACE_S = 3.0


def rows(run: Path) -> list[dict[str, object]]:
    found = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in found:
        for key in TIMING:
            row.pop(key, None)
    return found


def stopped_once(workdir: Path, resume: bool, in_validation: bool, delay: float) -> str:
    """Start ``glassloop train`` in a new process (``--resume`` after the first; forked, see
    tests/forkserver.py), SIGTERM it ``delay`` s after its header (``in_validation``: after a
    validation has begun), SIGKILL it GRACE_S later if it is still there; its stderr."""
    command = [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "cut"]
    proc = forkserver.Popen(
        [*command, *(["--resume"] if resume else [])], cwd=workdir, env={**os.environ, **PAUSES}
    )
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr or ()))  # type: ignore[arg-type]
    reader.start()
    for line in proc.stdout:  # the header's last line: the handlers are in place
        if line.startswith("preemption:"):
            break
    if in_validation:
        deadline = time.monotonic() + 60
        while "validating\n" not in errors and time.monotonic() < deadline:
            time.sleep(0.002)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:  # the scheduler's SIGKILL
        proc.kill()
        proc.wait()
    proc.stdout.read()
    reader.join()
    return "".join(errors)


def test_sigterm_at_ten_moments_lands_every_checkpoint_and_resumes_to_the_straight_run(
    tmp_path: Path,
) -> None:
    """Ten stops, every other one inside a validation: each lands a checkpoint of its last
    completed step within the grace, and the run resumed after all of them ends with the
    weights and every row (steps, mid-epoch validations, epochs) of the uninterrupted run."""
    shutil.copy(PREEMPTIBLE, tmp_path / "preemptible.py")
    (tmp_path / "cfg.toml").write_text(CONFIG)
    # (in this process, without the pauses: they change the timing, never the numbers)
    straight = run_glassloop("train", "cfg.toml", "--run-dir", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    assert "within train.grace_s = 3 s" in straight.stdout

    chosen = random.Random(35)
    owed = []  # what each checkpoint says is owed: "" (none), "step" or "epoch"
    for i in range(10):
        in_validation = i % 2 == 1
        delay = chosen.uniform(0, 0.05) if in_validation else chosen.uniform(0, 0.4)
        stderr = stopped_once(tmp_path, i > 0, in_validation, delay)
        assert "glassloop: stopped by SIGTERM after step " in stderr, stderr
        step = int(stderr.split("after step ")[1].split(";")[0])
        landed = tmp_path / "cut" / "checkpoints" / f"step-{step:08d}"
        assert (landed / "manifest.json").is_file(), stderr  # landed, whatever came after
        seconds = float(stderr.split(" in ")[1].split(" s;")[0])
        assert seconds < GRACE_S, stderr
        owed.append(json.loads((landed / "state.json").read_text())["loop"]["validation_due"])
    assert owed.count("") < 10 and sum(bool(o) for o in owed) >= 3, owed  # validations cut

    resumed = run_glassloop("train", "cfg.toml", "--run-dir", "cut", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert rows(tmp_path / "cut") == rows(tmp_path / "straight")
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
