"""Checkpoints written in the background (``checkpoint.async_save``): the step waits only
while the state is copied to host memory (run by the Trainer, not even for that: the
parameters and the optimizer's state are copied while the next step's forward and backward
run, and its optimizer step waits for the copy: :meth:`BackgroundSave.copy_behind`); a thread
writes, hashes and commits the copy while training goes on. One save in flight at a time: the
next one waits for it (and says so when that takes long), so host memory holds one copy of
the state, never a queue of them.

Why a thread and not a process: the write is file I/O and SHA-256, which release the GIL
(``glassloop.storage.hashed_files.write_digested``), and a thread shares the copy without
pickling it. What the writer costs the steps beside it is its CPU time (a second core is free
only when nothing else runs): SHA-256, and the kernel's for the page cache, 1.2-1.6 CPU
seconds of a 0.6 GB save on a VM, which large files now skip
(:class:`glassloop.storage.hashed_files.DirectWriter`).

An FSDP run's shards are written by every process, with DCP's ``async_save`` (its host copy,
then its own thread); rank 0's commit waits for them, so a checkpoint is complete, its
manifest covering every process's shards, only once all are written: a kill before that
leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from glassloop.distributed.world import new_gloo_group
from glassloop.errors import CheckpointWriteError
from glassloop.state import SaveTimes
from glassloop.storage.snapshot import HostCopy, Snapshot, snapshot

if TYPE_CHECKING:
    from glassloop.distributed.fsdp import ShardedState

# A wait for the previous save longer than this is said on the console: saves are then
# more frequent than the disk can take, and the step waits for the disk after all.
SAY_WAIT_S = 0.5


def yield_to_training() -> None:
    """Lower this thread's priority (Linux: ``nice`` is per thread, and the threads it starts,
    its hashers, inherit it), so the write and its SHA-256 take the time the training leaves
    rather than a core from it: with another job on the other core of two, SHA-256 of
    0.47 GB beside a training step slowed it by 0.225 s, by 0.046 s at nice 19 (and took
    0.55 s instead of 0.47 s)."""
    with contextlib.suppress(AttributeError, OSError):  # (elsewhere: as it was)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


TRAINER = "glassloop.loop"  # (the module of the Trainer's own step)
STEP = ("train_step", "forward_backward", "backward", "step")  # a subclass may replace them


class BackgroundSave:
    """The one checkpoint write in flight, its failure and its times."""

    def __init__(
        self, times: SaveTimes, say: Callable[[str], None] = print, *, sharded: bool = False
    ) -> None:
        self.copy = HostCopy()
        self.say = say
        self.times = times
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._step = 0
        # An FSDP run's shards: DCP's write in flight (waited for by the commit), over a
        # process group of the checkpoints' own (made now, by every process alike), so the
        # writer's collectives never interleave with training's on the default group.
        self._shards: Future[Any] | None = None
        self.group = new_gloo_group() if sharded else None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._copied: threading.Event | None = None  # set once the copy left for later is made

    def copy_behind(self, parts: Any, trainer: Any) -> None:
        """Copy the parameters and the optimizers' state in the background from now on, while
        the next step's forward and backward run (nothing changes them before the optimizer
        step, which waits for the copy: a hook of each optimizer in ``parts``), as
        torchtitan's and DCP's async saves do. For a loop that changes the parameters only
        in ``optimizer.step()``: the Trainer's (:meth:`glassloop.checkpoint.checkpointer.
        Checkpointer.attach`). Everything else (buffers: batch norm's change in the forward)
        is copied before ``save()`` returns, and everything when ``trainer`` has a step of its
        own (a ``train_step``, ``forward_backward``, ``backward`` or ``step`` of a subclass: SAM's
        perturbation, a clamp before the step may change the weights before the optimizer's)."""
        for hook in self._hooks:
            hook.remove()
        own_step = any(getattr(type(trainer), name).__module__ != TRAINER for name in STEP)
        self.optimizers = [] if own_step else [p for p in parts if isinstance(p, Optimizer)]
        self._hooks = [o.register_step_pre_hook(self.before_update) for o in self.optimizers]

    def before_update(self, *_: Any) -> None:
        """Until the copy left for later is made (an optimizer's step pre-hook: one call per
        step while saves are in the background)."""
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def _later(self) -> set[int]:
        """Where the tensors the copy may leave for later start: the optimizers' parameters
        and state."""
        tensors = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        tensors += [v for o in self.optimizers for s in o.state.values() for v in s.values()]
        return {t.data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}

    def write_shards(self, sharded: ShardedState, directory: Path, *, commits: bool) -> None:
        """Start an FSDP save: this process's shards copied to host memory now and written
        into ``directory`` in the background. The process that ``commits`` waits for them in
        its commit (:meth:`submit`: the checkpoint is complete only once every process's
        shards are written); any other one waits in a thread of its own, its failure raised
        as a commit's would be."""
        self.wait()  # one at a time: DCP's collectives of one save, then the next's
        self.raise_failure()
        started = time.perf_counter()
        self._shards = sharded.save_async(directory, self.group)
        if not commits:
            self.start(self._written, self._step, time.perf_counter() - started, 0)

    def _written(self) -> Path:
        """Wait for the shards in flight; DCP's failure (any process's) as a write failure."""
        shards, self._shards = self._shards, None
        if shards is not None:
            try:
                shards.result()
            except Exception as err:
                raise CheckpointWriteError(
                    f"checkpoint: could not write the shards: {str(err).splitlines()[0][:300]}; "
                    "the previous checkpoint is the newest"
                ) from err
        return Path()

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
        model: nn.Module | dict[str, torch.Tensor] | None,
        state: dict[str, Any],
        meta: dict[str, Any],
        commit: Callable[[Snapshot], Path],
        started: float,
        *,
        waited: bool = False,
    ) -> None:
        """Copy ``model``'s weights and ``state`` to host memory (what the step waits for),
        then ``commit`` the copy in the background, after the save before it; the
        previous save's failure is raised here instead. ``waited``: the caller waits for this
        one (a stop signal's, the final): its writer keeps its priority."""
        if self._shards is None:  # (an FSDP save waited in write_shards)
            self.wait()  # one at a time: its buffers are the copy's
            self.raise_failure()
        self.copy.begin(self._later() if self.optimizers and model is not None else None)
        snap = snapshot(model, state, meta, self.copy)
        self.copy.finish()
        self._copied = threading.Event() if self.copy.pending else None
        write = functools.partial(self._copy_then_commit, commit, snap, self._copied, waited)
        self.start(write, snap.step, time.perf_counter() - started, snap.nbytes)

    def _copy_then_commit(
        self,
        commit: Callable[[Snapshot], Path],
        snap: Snapshot,
        copied: threading.Event | None,
        waited: bool,
    ) -> Path:
        if copied is not None:
            try:
                self.copy.copy_later()
            finally:
                copied.set()  # (the optimizer step goes on; a failed copy fails the save)
        if not waited:  # (a save the run waits for, within a scheduler's grace: at full speed)
            yield_to_training()
        return self._commit_after_shards(commit, snap)

    def _commit_after_shards(self, commit: Callable[[Snapshot], Path], snap: Snapshot) -> Path:
        self._written()  # (every process's shards on disk before the manifest covers them)
        return commit(snap)

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
        for hook in self._hooks:  # (a fit's end: the optimizers are the user's again)
            hook.remove()
        self._hooks, self.optimizers = [], []
        if (failure := self.failure()) is not None:
            self.say(f"warning: {failure}")
