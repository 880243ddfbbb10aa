"""glassloop verify-resume stopped from outside: a SIGTERM reaches its training child (which is
waited for) and its temporary folder is removed; a kill -9 of it takes the child along
(Linux: the child's parent-death signal). Real processes, real signals (issue 32, item 4)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import forkserver
import pytest
from cli_runner import sets

LONG = [
    "data.name=synthetic", "data.num_samples=320", "data.batch_size=32", "data.num_features=8",
    "model.hidden=[16]", "train.epochs=100000", "train.progress=none", "scheduler.name=none",
]  # fmt: skip
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prctl")


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(n) for n in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def until(condition: object, what: str, limit: float = 120.0) -> None:
    """Poll ``condition()`` (a process's state has no event to wait on) up to ``limit`` s."""
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start(tmp: Path) -> tuple[forkserver.Popen, int, Path]:
    """verify-resume with TMPDIR=tmp, once its first training run has written its run dir:
    the process, its training child's pid and the temporary folder."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    command = [sys.executable, "-m", "glassloop", "verify-resume", *sets(LONG), "--kill-at", "5"]
    proc = forkserver.Popen(command, env=env)  # (a new process, forked: tests/forkserver.py)
    until(lambda: list(tmp.glob("glassloop-v*/straight/run.json")), "the straight run to start")
    until(lambda: children_of(proc.pid), "the training child")
    (folder,) = tmp.glob("glassloop-v*")
    return proc, children_of(proc.pid)[0], folder


def stop(child: int) -> None:
    """A child the feature failed to stop is not left training after the test."""
    if alive(child):
        os.kill(child, signal.SIGKILL)


def test_a_sigterm_stops_the_training_child_and_removes_the_temporary_folder(
    tmp_path: Path,
) -> None:
    proc, child, folder = start(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.strip().splitlines() == [
            "glassloop: verify-resume: stopped by SIGTERM; nothing verified"
        ]
        assert not alive(child)
        assert not folder.exists()
        assert not list(tmp_path.glob("glassloop-*"))  # (torch keeps its own cache here)
    finally:
        stop(child)


def test_a_kill_9_of_verify_resume_takes_its_training_child_along(tmp_path: Path) -> None:
    proc, child, _ = start(tmp_path)
    try:
        proc.kill()
        proc.communicate(timeout=60)
        until(lambda: not alive(child), "the orphaned child to die", limit=30)
    finally:
        stop(child)
