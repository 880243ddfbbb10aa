"""Checkpoints written in the background (``checkpoint.async_save``): the step waits only
while the state is copied to host memory; a thread writes, hashes and commits the copy while
training goes on. One save in flight at a time: the next one waits for it (and says so when
that takes long), so host memory holds one copy of the state, never a queue of them.

Why a thread and not a process: the write is file I/O and SHA-256, which release the GIL
(``glassloop.storage.atomic.write_digested``), and a thread shares the copy without pickling it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.errors import ConfigError
from glassloop.state import SaveTimes
from glassloop.storage.snapshot import HostCopy, Snapshot, snapshot

# A wait for the previous save longer than this is said on the console: saves are then
# more frequent than the disk can take, and the step waits for the disk after all.
SAY_WAIT_S = 0.5


class BackgroundSave:
    """The one checkpoint write in flight, its failure and its times."""

    def __init__(
        self, times: SaveTimes, say: Callable[[str], None] = print, *, sharded: bool = False
    ) -> None:
        if sharded:
            raise ConfigError(
                "config: checkpoint.async_save is not available with train.strategy = "
                "'fsdp' yet (its shards are written by every process); set it to false"
            )
        self.copy = HostCopy()
        self.say = say
        self.times = times
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._step = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the save in flight (if any) has committed or failed; says so when it
        holds up the step for long."""
        if self._thread is None:
            return
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - start
        if waited > SAY_WAIT_S:
            self.say(
                f"checkpoint: waited {waited:.1f} s for the save of step {self._step} to "
                "finish (one save at a time; save less often, or to a faster disk)"
            )

    def submit(
        self,
        model: nn.Module | dict[str, torch.Tensor],
        state: dict[str, Any],
        meta: dict[str, Any],
        commit: Callable[[Snapshot], Path],
        started: float,
    ) -> None:
        """Copy ``model``'s weights and ``state`` to host memory (what the step waits for),
        then ``commit`` the copy in the background, after the save before it; the
        previous save's failure is raised here instead."""
        self.wait()  # one at a time: its buffers are the copy's
        self.raise_failure()
        self.copy.begin()
        snap = snapshot(model, state, meta, self.copy)
        self.copy.finish()
        self.start(
            functools.partial(commit, snap), snap.step, time.perf_counter() - started, snap.nbytes
        )

    def start(self, write: Callable[[], Path], step: int, blocking: float, nbytes: int) -> None:
        """Run ``write`` (a commit of a snapshot already copied) in the background; the
        caller waited for the previous save first (:meth:`wait`)."""
        assert not self.busy, "one save in flight at a time"
        self._step = step
        began = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run,
            args=(write, began, blocking, nbytes),
            name=f"glassloop-checkpoint-{step}",
            daemon=False,  # an exiting interpreter lets a save in flight commit first
        )
        self._thread.start()

    def _run(self, write: Callable[[], Path], began: float, blocking: float, nbytes: int) -> None:
        try:
            write()
            self.times.add(blocking, blocking + time.perf_counter() - began, nbytes)
        except BaseException as err:  # handed to the training thread (take_failure)
            self._failure = err

    def failure(self) -> Exception | None:
        """The failure of a finished save, once (``None``: none, or still running); an
        interrupt in the writer (KeyboardInterrupt, SystemExit) is raised as it is."""
        if self.busy:
            return None
        failure, self._failure = self._failure, None
        if failure is None or isinstance(failure, Exception):
            return failure
        raise failure

    def raise_failure(self) -> None:
        if (failure := self.failure()) is not None:
            raise failure

    def close(self) -> None:
        """Let the save in flight commit (an ending run); its failure said as a warning
        (the run may be ending with an error of its own: that one is raised)."""
        self.wait()
        if (failure := self.failure()) is not None:
            self.say(f"warning: {failure}")
