"""The glassloop command run in the test process: the same ``main()`` the console script
calls, with stdout/stderr captured and the exit code returned. A subprocess per call would
cost an interpreter and a torch import each (~1 s, ~3 s on CI); tests that need a real
process (signals, kill -9, torchrun) still start one."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from glassloop.cli.main import main


def run_glassloop(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(["glassloop", *args], capture_output=True, text=True)``."""
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse: --help, usage errors
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except Exception:  # what the console script would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["glassloop", *args], code, out.getvalue(), err.getvalue())


def run_python(code: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``code`` as a script in a fresh interpreter in ``cwd`` (as a user runs a copied
    example): stdout and stderr captured."""
    script = cwd / "example.py"
    script.write_text(code, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def run_group(
    args: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None,
    capture_output: bool = True, text: bool = True, check: bool = False,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run(args, ...)`` in a process group of its own: on a timeout the whole group
    is killed (a launch's torchrun and its workers too, which ``subprocess.run`` would leave
    running), then ``TimeoutExpired`` is raised as usual."""
    assert capture_output and text and not check  # (the only way the tests call it)
    proc = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def sets(items: list[str]) -> list[str]:
    """``["a.b=1", "c.d=2"]`` -> ``["--set", "a.b=1", "--set", "c.d=2"]``."""
    return [arg for item in items for arg in ("--set", item)]


def cli(capsys: Any, *args: str) -> tuple[int, str, str]:
    """``main(args)`` with pytest's ``capsys``: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a server's, a rendezvous')."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
