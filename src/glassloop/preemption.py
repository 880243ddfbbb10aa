"""Graceful stop on SIGTERM/SIGINT/SIGUSR1/SIGUSR2: finish the optimizer step, checkpoint, exit.

The first signal only sets a flag that the loop reads after each optimizer step (never in
the middle of one). A second signal aborts at once with exit code ``128 + signal`` without
touching the last good checkpoint (a write in progress leaves only a temporary directory,
removed at the next start).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from glassloop.options import SIGNALS, TrainOptions

# Every signal a run may be told to stop on (``train.stop_signals``): what loader workers
# ignore, so that one sent to the whole process group reaches the main process alone.
STOP_SIGNALS = tuple(signal.Signals[f"SIG{name}"] for name in SIGNALS)
DEFAULT = tuple(TrainOptions().stop_signals)  # TERM, INT, USR1, USR2


class Preempted(Exception):
    """Training stopped on a signal; ``checkpoint`` is where it was saved (or None)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no run_dir: not saved"
        super().__init__(f"stopped by {name} after step {step}; {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager that turns the first of ``names`` (default SIGTERM, SIGINT, SIGUSR1,
    SIGUSR2) into ``self.received``.

    Outside the main thread (where handlers cannot be installed) it does nothing.
    """

    def __init__(self, names: Sequence[str] = DEFAULT) -> None:
        self.signals = [signal.Signals[f"SIG{name}"] for name in names]
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            os._exit(128 + signum)  # second signal: abort now, write nothing
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: workers ignore the stop signals sent to the process group,
    so the main process can finish its step. They die with the main process (Linux: a
    parent-death signal, also after a ``kill -9`` of the main process); the loader stops
    them itself when an epoch's iteration ends (:func:`glassloop.data.loaders.close_workers`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``prctl``; a no-op
    elsewhere)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
