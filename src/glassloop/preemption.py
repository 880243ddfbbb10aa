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

import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
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
        super().__init__(f"stopped by {name} after step {step}; {where}")

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
        self.waiting = False  # in a wait for data the signal itself may end (see batches)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            os._exit(128 + signum)  # second signal: abort now, write nothing
        self.received = signum
        if self.waiting:  # blocked in a loader's next(): nothing of a step is half done
            self.waiting = False
            raise StopRequested(signum)

    def batches(
        self, loader: Iterable[Any], window: int, *, cut: bool, position: Any = None
    ) -> Iterator[Any]:
        """``loader``'s batches; with ``cut``, a stop signal that arrives while the loop waits
        for one raises :class:`StopRequested` at once: a slow loader (a network dataset,
        workers starting) must not outlast a scheduler's grace. The step being gathered
        (``window`` micro-batches) is dropped whole, so the data position is the last
        completed step's: the loop counts only completed steps' batches, and ``position`` (a
        loader that counts what it handed over; its ``state_dict()`` is two integers, read
        at each window's start) is put back as it was there. ``cut`` is off with several
        processes (they agree on a stop at the next step's collective instead) and for a
        loader with a position of its own that is not ``position``."""
        iterator = iter(loader)
        handed, saved = 0, None
        while True:
            if cut and position is not None and handed % window == 0:
                saved = position.state_dict()
            try:
                self.waiting = cut and self.received is None
                try:
                    batch = next(iterator)
                finally:
                    self.waiting = False
            except StopIteration:
                return
            except StopRequested:  # (also one raised as next() returned: the batch is dropped)
                if saved is not None:
                    position.load_state_dict(saved)
                raise
            handed += 1
            yield batch

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if _active is self:
            _active = None


_active: StopSignals | None = None  # the fit whose signals are being watched (main thread)


def watching() -> bool:
    """Whether a fit is watching for stop signals (alike in every process of a job)."""
    return _active is not None


def requested() -> int:
    """The stop signal this process received during the current fit (0: none)."""
    return (_active.received or 0) if _active is not None else 0


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
