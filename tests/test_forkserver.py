"""tests/forkserver.py gives what the tests that use it rely on: each command a new process
(its own pid, its own hash seed from the one before it, the cwd, environment and arguments
given), the exit code or the signal that ended it, a real SIGKILL, a timeout that kills it,
and a refusal where a fork would differ from a new interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

SCRIPT = """
import os, sys
print(os.getpid(), hash("glassloop"), os.getcwd(), sys.argv, os.environ.get("ASKED"))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
if sys.argv[1] == "raise":
    raise RuntimeError("raised")
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def test_each_command_is_a_new_process_with_its_own_exit(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    python = sys.executable
    env = {**os.environ, "ASKED": "yes"}
    first = forkserver.run([python, "script.py", "3"], cwd=tmp_path, env=env, timeout=60)
    second = forkserver.run([python, str(tmp_path / "script.py"), "0"], cwd="/", timeout=60)
    assert (first.returncode, second.returncode) == (3, 0)
    pid, seed, cwd, argv, asked = first.stdout.split(maxsplit=4)
    assert (cwd, argv, asked) == (str(tmp_path), "['script.py',", "'3'] yes\n")
    assert first.stderr == "to stderr\n"
    pid2, seed2, cwd2, *_ = second.stdout.split()
    assert len({pid, pid2, str(os.getpid())}) == 3 and cwd2 == "/"
    assert seed != seed2  # (a run and its resume never share a hash seed)
    killed = forkserver.run([python, "script.py", "kill"], cwd=tmp_path, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    raised = forkserver.run([python, "script.py", "raise"], cwd=tmp_path, timeout=60)
    assert raised.returncode == 1 and raised.stderr.endswith("RuntimeError: raised\n")
    helped = forkserver.run([python, "-m", "glassloop", "--version"], cwd=tmp_path, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("glassloop ")


def test_a_timeout_kills_it_and_other_interpreters_are_refused(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = forkserver.Popen([sys.executable, "script.py", "sleep"], cwd=tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.5)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, "script.py", "sleep"], cwd=tmp_path, timeout=0.5)
    threads = {**os.environ, "OMP_NUM_THREADS": "7"}  # (torch read it when it was imported)
    with pytest.raises(ValueError, match=r"\['OMP_NUM_THREADS'\] differ"):
        forkserver.run([sys.executable, "script.py", "0"], env=threads, timeout=60)
    with pytest.raises(ValueError, match=r"runs `python -m module \.\.\.` or a script"):
        forkserver.run([sys.executable, "-c", "pass"], timeout=60)
