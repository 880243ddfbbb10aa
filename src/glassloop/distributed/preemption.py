"""Graceful stop on SIGTERM/SIGINT/SIGUSR1/SIGUSR2: checkpoint the last step, exit.

The first signal sets a flag that the loop reads after each optimizer step (never in the
middle of one). What is not a step does not wait for its end: a validation (epoch-end or
mid-epoch) reads the flag before each batch and is abandoned (:class:`StopRequested`; its
partial numbers are never reported, and the resumed run runs it again), and a wait for the
next batch of data is cut short by the signal itself (one process; several agree at the
next step). The checkpoint is then the last completed step's. A second signal aborts at
once with exit code ``128 + signal`` without touching the last good checkpoint (a write in
progress leaves only a temporary directory, removed at the next start).

Why a flag and not an exception everywhere: an exception raised in the middle of an
optimizer step or a checkpoint write would leave a half-updated model or a half-written
file; the phases above change nothing that is saved, so leaving them at once is safe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from glassloop.options import SIGNALS, TrainOptions

# Every signal a run may be told to stop on (``train.stop_signals``): what loader workers
# ignore, so that one sent to the whole process group reaches the main process alone.
STOP_SIGNALS = tuple(signal.Signals[f"SIG{name}"] for name in SIGNALS)
DEFAULT = tuple(TrainOptions().stop_signals)  # TERM, INT, USR1, USR2


class Preempted(Exception):
    """Training stopped on a signal; ``checkpoint`` is where it was saved (or None)."""

    def __init__(
        self, signum: int, step: int, checkpoint: str | None, seconds: float | None = None
    ) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.seconds = seconds  # from acting on the signal to the checkpoint's commit
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no run_dir: not saved"
        if checkpoint and seconds is not None:
            where += f" in {seconds:.2f} s"
        self.summary = f"stopped by {name} after step {step}; {where}"  # (the CLI's hint: its own)
        hint = "; continue with trainer.fit(..., resume='auto')" if checkpoint else ""
        super().__init__(self.summary + hint)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequested(BaseException):
    """A stop signal acted on in the middle of a phase that changes nothing a checkpoint
    holds (a validation, a wait for data): the phase is abandoned and the run stops with the
    last completed step's checkpoint. A ``BaseException``, as ``KeyboardInterrupt``: an
    ``except Exception`` in a user's ``evaluate`` or dataset does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """Context manager that turns the first of ``names`` (default SIGTERM, SIGINT, SIGUSR1,
    SIGUSR2) into ``self.received``; while it is active, :func:`requested` reads it.

    Outside the main thread (where handlers cannot be installed) it does nothing.
    """

    def __init__(self, names: Sequence[str] = DEFAULT) -> None:
        self.signals = [signal.Signals[f"SIG{name}"] for name in names]
        self.received: int | None = None
        self.waiting = False  # in a wait for data the signal itself may end (data.position)
        self.validating = False  # in a validation a stop signal abandons (validating())
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            os._exit(128 + signum)  # second signal: abort now, write nothing
        self.received = signum
        if self.waiting:  # blocked in a loader's next(): nothing of a step is half done
            self.waiting = False
            raise StopRequested(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)


# The fits watching for stop signals, innermost last (a fit inside a callback's: its own
# handlers while it runs, the outer one's again after). Signals are the process's, hence
# module state; what reads it: a validation in progress (glassloop.evaluation.validator, fsdp).
_ACTIVE: list[StopSignals] = []


def requested() -> int:
    """The stop signal this process received during the current fit (0: none).

    >>> with StopSignals(["USR2"]) as signals:
    ...     signals.received = signal.SIGUSR2  # (what the handler does)
    ...     requested() == signal.SIGUSR2
    True
    >>> requested()
    0
    """
    return (_ACTIVE[-1].received or 0) if _ACTIVE else 0


@contextlib.contextmanager
def validating() -> Iterator[None]:
    """The scope of a validation inside ``fit`` that a stop signal abandons (what an FSDP
    evaluation's evened forwards agree on, :func:`glassloop.distributed.fsdp.agree_on_a_stop`; an
    evaluation a callback runs is never abandoned)."""
    signals = _ACTIVE[-1] if _ACTIVE else None
    if signals is not None:
        signals.validating = True
    try:
        yield
    finally:
        if signals is not None:
            signals.validating = False


def abandoning() -> bool:
    """Whether a validation that a stop signal abandons is in progress (alike in every
    process of a job)."""
    return bool(_ACTIVE) and _ACTIVE[-1].validating


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
