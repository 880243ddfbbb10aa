"""``glassloop train --nproc N``: supervise torchrun and its workers, and exit with the code a
worker said, not torchrun's.

Both halves of the arrangement live here: the launcher (:func:`launch_torchrun`, which starts
torchrun with a folder named in ``GLASSLOOP_EXIT_DIR``) and the worker's side
(:func:`worker_started`, :func:`worker_finished`), which the command calls around its work.
No torch here: the command imports this module before it parses its arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, NoReturn

from glassloop.distributed.preemption import die_with_parent
from glassloop.storage.redaction import redact

# Set by --nproc for its workers: where each records its exit code.
EXIT_DIR = "GLASSLOOP_EXIT_DIR"


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run torchrun with the command ``argv`` minus ``--nproc`` and return the workers' own
    exit code (torchrun itself says 1 for any failure: a preemption would read as a crash, a
    config refusal as a bug). Each worker records its code in ``GLASSLOOP_EXIT_DIR``; rank 0's
    code wins, then the first non-zero one; torchrun's code only when no worker recorded one
    (a worker that died); a worker killed by a signal (``kill -9``, the OOM killer): 128 + N,
    as a shell says, whatever the others said after it. SIGTERM/SIGINT to this process go on
    to torchrun, which forwards them to the workers; SIGUSR1/SIGUSR2 go on as SIGTERM
    (torchrun would die of them).
    torchrun, and each worker, die with the process that started them (a parent-death
    signal): a ``kill -9`` of this command leaves nothing running headless, holding the run
    directory's lock.

    ``glassloop train my.toml --nproc 2 --run-dir runs/a`` is
    ``launch_torchrun(2, ["train", "my.toml", "--nproc", "2", "--run-dir", "runs/a"])``: it runs
    ``python -m torch.distributed.run --standalone --nproc-per-node=2 -m glassloop train my.toml
    --run-dir runs/a`` and returns 0 when both workers said 0.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "glassloop",
        *without_nproc(argv),
    ]
    sys.stdout.flush()
    # (OMP_NUM_THREADS set: torchrun's banner about setting it is not printed.)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with tempfile.TemporaryDirectory(prefix="glassloop-exit-") as exit_dir:
        child = subprocess.Popen(
            command,
            env={**env, EXIT_DIR: exit_dir},
            preexec_fn=die_with_parent,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        relay = StderrRelay(child.stderr)

        def forward(signum: int, frame: object) -> None:
            # torchrun passes TERM and INT on to the workers; USR1/USR2 (a scheduler's early
            # warning) would end torchrun itself, and the workers unsaved: they go as TERM.
            usr = signum in (signal.SIGUSR1, signal.SIGUSR2)
            child.send_signal(signal.SIGTERM if usr else signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, forward)
        code = child.wait()
        relay.join()
        recorded = {}
        for path in Path(exit_dir).glob("rank-*"):
            with contextlib.suppress(OSError, ValueError):
                recorded[int(path.name[5:])] = int(path.read_text())
    # torchrun's own report of a failed job: noise when a process said why it stopped (its
    # one line, its recorded code) and the others were only stopped by torchrun (SIGTERM);
    # the only clue when one died on its own (a crash, the kernel's OOM killer).
    killed = relay.killed_by()
    if code != 0 and (not any(recorded.values()) or killed):
        relay.print_held()
    if killed:  # (a worker kill -9'd or OOM-killed: its 128 + N, not the others' errors after)
        return 128 + killed[0]
    if recorded.get(0):
        return recorded[0]
    failed = [recorded[rank] for rank in sorted(recorded) if recorded[rank]]
    if failed:
        return failed[0]
    if len(recorded) == nproc:  # every worker finished its command and said 0
        return 0
    return code if code >= 0 else 128 - code  # killed by a signal: 128 + N, as a shell says


def without_nproc(argv: list[str]) -> list[str]:
    """The command a worker runs: ``argv`` less ``--nproc N`` / ``--nproc=N`` (a worker that
    launched torchrun again would never end).

    >>> without_nproc(["train", "--nproc", "2", "x.toml", "--nproc=3"])
    ['train', 'x.toml']
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def is_worker() -> bool:
    """Whether this process is a worker started by :func:`launch_torchrun`."""
    return EXIT_DIR in os.environ and "RANK" in os.environ


def worker_started() -> None:
    """A worker dies with torchrun, which dies with the launcher: nothing is left running
    headless after a ``kill -9`` of the command."""
    die_with_parent()


def worker_finished(code: int) -> NoReturn:
    """Record ``code`` for the launcher and leave at once."""
    with contextlib.suppress(OSError):
        Path(os.environ[EXIT_DIR], f"rank-{os.environ['RANK']}").write_text(str(code))
    # Its work is done and recorded: leave without the interpreter's teardown, where the
    # C++ destructors of a gloo process group that was already left can abort the process
    # now and then ("terminate called without an active exception", SIGABRT), which
    # torchrun would report as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StderrRelay:
    """Copies torchrun's stderr (its workers' too) to ours as it comes, with two changes: an
    error line every process prints (``glassloop: error: ...``) is shown once, and what
    torchrun prints once a worker failed (its log lines, its traceback and report, 40 lines
    that repeat the exit code) is held back for :meth:`print_held`."""

    REPORT = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ .*torch/distributed/elastic/")

    def __init__(self, stream: Any) -> None:
        self.held: list[str] = []
        self.seen: set[str] = set()
        self.thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self.thread.start()

    def _copy(self, stream: Any) -> None:
        reporting = False
        for line in stream:
            reporting = reporting or bool(self.REPORT.match(line))
            if reporting:
                self.held.append(line)
            elif line.startswith("glassloop: error:") and line in self.seen:
                continue
            else:
                self.seen.add(line)
                sys.stderr.write(redact(line))  # (torchrun's lines quote the command line)
                sys.stderr.flush()

    def join(self) -> None:
        self.thread.join(timeout=10)

    def killed_by(self) -> list[int]:
        """The signals torchrun reports its workers killed by, but for its own SIGTERM."""
        codes = [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", "".join(self.held))]
        return [-code for code in codes if code < 0 and code != -signal.SIGTERM]

    def print_held(self) -> None:
        sys.stderr.write(redact("".join(self.held)))
        sys.stderr.flush()
