"""The checkpoint policy: when to save, how many to keep, which one is best, and how to resume
with the checks that keep a resume honest. Storage (atomic files, verification, pruning)
is :mod:`glassloop.run_dir.checkpoints`; this module decides, that one writes.

The Trainer hands it the model, the record and the guard when it is built and the stateful
parts once per ``fit`` (:meth:`Checkpointer.attach`, as torchtitan's ``states=``); the loop
then saves with one call and resumes with one::

    checkpointer = Checkpointer(RunDir(run_dir), CheckpointConfig(every_n_steps=100), model=model)
    checkpointer.attach({"loop": state, "optimizer": optimizer}, loader=train_loader)
    checkpointer.resume("auto", epochs=10)
    if checkpointer.due_after_step(step):
        checkpointer.save()
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

import glassloop.distributed.fsdp as fsdp
from glassloop.best import improves, is_number, monitor_mode
from glassloop.checkpoint.background import BackgroundSave
from glassloop.checkpoint.resume import (
    check_compatible,
    check_training_state,
    config_applied,
    config_differences,
)
from glassloop.data.position import global_batch, replay_caveat
from glassloop.distributed.fsdp import ShardedState
from glassloop.distributed.world import World, all_reduce, gather_objects, unwrap_model
from glassloop.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    GlassloopError,
    write_failure,
)
from glassloop.options import CheckpointConfig, RunInfo
from glassloop.rng import capture_rng_state, restore_rng_state
from glassloop.run_dir.checkpoints import (
    Checkpoint,
    begin_staging,
    checkpoints_dir,
    find_resumable,
    last_good,
    not_finite,
    read_checkpoint,
    refuse_not_finite,
    remove_marked,
    require_run_dir,
    staging_dir,
    step_dir_name,
    step_dirs,
)
from glassloop.run_dir.layout import BEST, SHARDS
from glassloop.run_dir.local_store import LocalStore
from glassloop.run_dir.manifest import FORMAT_VERSION
from glassloop.run_dir.run import RunDir
from glassloop.state import EpochRecord, TrainState
from glassloop.storage.frozen_base import FrozenBase, adapter_alone, recorded_names
from glassloop.storage.snapshot import Snapshot, snapshot
from glassloop.storage.weights import check_fit, load_checked


class Watch(Protocol):
    """What a checkpoint needs of the non-finite guard (:class:`glassloop.step.guards.
    NonFiniteWatch`): its verdict before a save, and the loss-spike window it keeps."""

    spike: float

    def check(self, state: TrainState, world: World) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


LATER_PARTS = ("micro_batches",)  # stateful parts older checkpoints do not hold
STATEFUL = ("state_dict", "load_state_dict")  # what every stateful part has


class Checkpointer:
    """Saves and restores a run's checkpoints under ``run_dir`` (does nothing without one).

    Every process calls :meth:`save` (the state holds every process's RNG); rank 0 writes and
    the others wait for its verdict, so a failed write fails every process.
    """

    def __init__(
        self,
        run: RunDir | Path | None,
        policy: CheckpointConfig | None = None,
        *,
        model: nn.Module | None = None,
        record: EpochRecord | None = None,
        callbacks: Sequence[Any] = (),
        info: RunInfo | None = None,
        watch: Watch | None = None,
        shards: ShardedState | None = None,
        device: torch.device | None = None,
        say: Callable[[str], None] = print,
        grace_s: float = 0.0,
    ) -> None:
        """``run``: the run directory (:class:`glassloop.run_dir.run.RunDir`: its processes,
        the object-storage run each committed checkpoint is uploaded to, where each save's
        seconds and bytes are recorded; a path: one process's). Handed once what every
        checkpoint holds beyond :meth:`attach`'s: the ``model`` whose weights it saves (an
        FSDP run's: ``shards``), the epoch's ``record``, the callbacks (their states), what
        the run records (``info``), the non-finite ``watch`` (never a save after a NaN step;
        its loss-spike window) and the ``device`` the state loads onto; ``say``: where a line
        about a slow background save goes; ``grace_s``: the seconds a stop signal leaves
        before SIGKILL, said against the first save's time."""
        self.run = run if isinstance(run, RunDir) else RunDir(run)
        self.run_dir, self.world, self.remote = self.run.path, self.run.world, self.run.remote
        self.times, self.grace_s = self.run.times, grace_s  # (times: each save's seconds)
        self.policy = policy if policy is not None else CheckpointConfig()
        self.model = model if model is not None else nn.Module()
        self.record = record if record is not None else EpochRecord()
        self.callbacks, self.watch, self.shards = callbacks, watch, shards
        self.info = info if info is not None else RunInfo()
        self.say = say
        self.device = device if device is not None else torch.device("cpu")
        self.parts: dict[str, Any] = {"loop": TrainState()}
        self.loader: Any = None
        self.trainer: Any = None  # (the Trainer, for on_checkpoint: attach())
        self.global_batch: int | None = None  # meta.json's (per micro-batch, every process)
        self.run.mirror(self.policy.keep_last, say, sharded=shards is not None)
        # A fine-tuned model's frozen tensors stay out of its checkpoints; their digests go
        # in (glassloop.storage.frozen_base). An FSDP run's shards hold every tensor.
        self.base = FrozenBase()  # (its digests: taken when training starts, in resume())
        self.leave_base_out = not self.policy.save_frozen and shards is None
        self.run.base = self.final_base(unwrap_model(self.model))  # (final weights: not it)
        self.background = (
            BackgroundSave(self.times, say, sharded=shards is not None)
            if self.policy.async_save
            else None
        )

    def attach(self, parts: dict[str, Any], *, loader: Any = None, trainer: Any = None) -> None:
        """Hand it the stateful parts, once per ``fit``: the objects by name (``None``: not
        part of this run; the loop's :class:`~glassloop.state.TrainState` as ``"loop"``), the
        training ``loader`` (its generators join the RNG state) and the ``trainer`` the
        callbacks' ``on_checkpoint`` is handed (a background save copies behind its loop).
        One without ``state_dict()`` and ``load_state_dict()`` is refused here, not at a save."""
        for name, part in parts.items():
            if part is not None and not all(hasattr(part, method) for method in STATEFUL):
                raise GlassloopError(
                    f"stateful()[{name!r}] is a {type(part).__name__}, which has no "
                    "state_dict()/load_state_dict(); give it both, or leave it out"
                )
        self.parts, self.loader, self.trainer = parts, loader, trainer
        self.global_batch = global_batch(loader, self.world)  # (None: not known)
        if self.background is not None and trainer is not None:
            self.background.copy_behind(parts.values(), trainer)

    @property
    def state(self) -> TrainState:
        loop: TrainState = self.parts["loop"]
        return loop

    # ------------------------------------------------------------------------------ when
    def due_after_step(self, step: int) -> bool:
        every = self.policy.every_n_steps
        return self.run_dir is not None and bool(every) and step % every == 0

    def due_after_epoch(self, epoch: int) -> bool:
        every = self.policy.every_n_epochs
        return self.run_dir is not None and bool(every) and epoch % every == 0

    def better(self, row: dict[str, Any], best: float | None) -> float | None:
        """The monitored value of ``row`` if it beats ``best`` (``None`` otherwise, or when
        nothing is monitored)."""
        monitor = self.policy.monitor
        if not monitor:
            return None
        if monitor not in row:
            names = sorted(k for k, v in row.items() if is_number(v) and k != "epoch")
            raise ConfigError(
                f"config: checkpoint.monitor {monitor!r} is not a metric of this run "
                f"(available: {', '.join(names)})"
            )
        value = float(row[monitor])
        mode = monitor_mode(monitor, self.policy.mode)
        return value if improves(value, best, mode) else None

    # ------------------------------------------------------------------------------ save
    def save(
        self, *, finished: bool = False, best: bool = False, wait: bool = False
    ) -> Path | None:
        """Commit ``checkpoints/step-<step>/`` of where the run stands and prune to
        ``keep_last`` (``best``: ``RUN_DIR/best/`` instead); the path, or ``None`` without a
        run directory. Every process calls it: the state is gathered from all (a
        collective), an FSDP run's shards are written by each, rank 0 commits.

        With ``async_save`` it returns once the state is copied to host memory and the
        commit happens in the background (:mod:`glassloop.checkpoint.background`); a final save
        (``finished``) or one told to (``wait``: a stop signal's) waits for it. A background
        save's failure is raised at the next step row (:meth:`poll`) or the next save, in
        every process."""
        if self.watch is not None:
            self.watch.check(self.state, self.world)  # never a checkpoint after a NaN step
        if self.run_dir is None:
            return None
        self._agree(self._earlier_failure(), self.run_dir)  # (in every process)
        started, shards, wait = time.perf_counter(), self.shards, wait or finished
        state, meta = self.state_dict(), self.meta(finished=finished)
        step, weights = self.state.step, None
        if shards is None and self.world.is_main:  # less the frozen base, its digests in meta
            weights, base = self.weights()
            meta.update({"base": base} if base else {})
        target = (
            self.run_dir / BEST if best else checkpoints_dir(self.run_dir) / step_dir_name(step)
        )
        staged = self._stage(target, shards, step) if shards is not None else None
        failure: Exception | None = None
        if self.world.is_main:  # one writer; the others wait for its verdict below
            try:
                require_run_dir(self.run_dir)  # never recreated half-empty
                if weights is not None:
                    refuse_not_finite(self.run_dir, weights, step)
                if self.background is not None:  # copied now, committed in the background
                    commit = functools.partial(self._commit, best=best, staged=staged)
                    self.background.submit(weights, state, meta, commit, started, waited=wait)
                else:
                    snap = snapshot(weights, state, meta)
                    target = self._commit(snap, best=best, staged=staged)
                    elapsed = time.perf_counter() - started
                    self.times.add(elapsed, elapsed, snap.nbytes)
            except Exception as err:  # (any: the other processes wait for this verdict)
                failure = err
        self._agree(failure, target)
        if wait:  # (a final save, a stop signal's)
            self.wait()
        self.times.held_s += time.perf_counter() - started  # (the epoch row's checkpoint_s)
        self._say_grace()
        for callback in () if best else self.callbacks:  # (every process, the save agreed)
            if hasattr(callback, "on_checkpoint"):
                callback.on_checkpoint(self.trainer, target)
        return target

    def final_base(self, model: nn.Module) -> FrozenBase | None:
        """The frozen base the run's final weights leave out (``policy.final_weights``:
        "trainable", or "auto" for a peft adapter); ``None``: they are whole."""
        alone = adapter_alone(model, self.policy.final_weights)
        return self.base if alone and self.shards is None else None

    def weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """What a checkpoint's model.safetensors holds: the model's state dict less its frozen
        base, and the base's record for meta.json (``None``: nothing left out)."""
        if not self.leave_base_out:
            return unwrap_model(self.model).state_dict(), None
        return self.base.split(self.model)

    def _say_grace(self) -> None:
        """Once the first save's time is known: that time against ``grace_s``."""
        if (line := self.times.against_grace(self.grace_s)) is not None:
            self.say(line)

    def _commit(self, snap: Snapshot, *, best: bool, staged: Path | None) -> Path:
        """Write ``snap`` (as ``best/``, or as a step's checkpoint, then prune)."""
        assert self.run_dir is not None
        store = LocalStore(self.run_dir)
        target = store.commit(snap, best=best, staged=staged)
        if not best:
            with self.remote.protected() if self.remote else contextlib.nullcontext() as busy:
                store.prune(self.policy.keep_last, keep=busy)  # (never one uploading)
        if self.remote is not None:  # uploaded in the background, in order
            self.remote.push_checkpoint(target)
        return target

    def poll(self) -> None:
        """Raise the failure of a background save or upload that has ended (one process: at
        the next step row; several agree on it at the next save, not in a collective every
        step)."""
        if not self.world.distributed and (failure := self._earlier_failure()) is not None:
            raise failure
        self._say_grace()

    def _earlier_failure(self) -> Exception | None:
        """A background save's or upload's failure since the last look (rank 0's)."""
        failure = self.background.failure() if self.background is not None else None
        if failure is None and self.remote is not None:
            failure = self.remote.failure()
        return failure

    def wait(self) -> None:
        """Until the background save in flight has committed; its failure raised in every
        process (every process calls it: a final save, a stop signal's save)."""
        if self.background is not None:
            self.background.wait()
            self._agree(self.background.failure(), self.run_dir or Path())

    def close(self) -> None:
        """Let a save in flight commit before the run ends (its failure: a warning)."""
        if self.background is not None:
            self.background.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs: each part's
        ``state_dict()``, the epoch's losses so far (every process's: a collective), the
        callbacks' states, the RNG, the loader's generators included (every process's:
        dropout masks differ per process; a collective), and with a loss-spike guard the
        losses its next steps are measured against (every process's own)."""
        parts, world = self.parts, self.world
        rng = capture_rng_state(self.loader)
        state = {
            **{
                name: part.state_dict() if part is not None else None
                for name, part in parts.items()
            },
            **self.record.state_dict(world),
            "callbacks": [
                cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.callbacks
            ],
            "rng": rng,
            "rng_per_rank": gather_objects(rng) if world.distributed else None,
        }
        if self.watch is not None and self.watch.spike:  # (absent otherwise: as before it)
            window = self.watch.state_dict()
            state["loss_spike"] = gather_objects(window) if world.distributed else [window]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`state_dict` back into the parts; the global RNGs last, right before
        training goes on. A part the state lacks is a ``KeyError`` (reported as "does not
        fit")."""
        world = self.world
        for name, part in self.parts.items():
            # (a part added since: absent from older checkpoints, it starts fresh)
            saved = state.get(name) if name in LATER_PARTS else state[name]
            if part is not None and saved is not None:
                part.load_state_dict(saved)
        self.record.load_state_dict(state, self.device, world)
        # The loss-spike windows, each process its own. None: written without the guard or
        # before it; written by another number of processes (a resharded FSDP resume): the
        # new processes start fresh windows, as every resume did before.
        windows = state.get("loss_spike") or []
        if self.watch is not None and self.watch.spike and len(windows) == world.size:
            self.watch.load_state_dict(windows[world.rank])
        for callback, saved in zip(self.callbacks, state["callbacks"], strict=False):
            if saved is not None and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(saved)
        per_rank = state.get("rng_per_rank") or []
        # (A resharded FSDP resume has another number of processes: rank 0's RNG for all.)
        same_world = len(per_rank) == world.size
        restore_rng_state(per_rank[world.rank] if same_world else state["rng"], self.loader)

    def _stage(self, target: Path, shards: ShardedState, step: int) -> Path:
        """Every process writes its part of the weights and optimizer state into the staging
        directory of ``target`` (named by rank 0's pid); rank 0 then commits it whole."""
        assert self.run_dir is not None
        if not fsdp.all_finite(shards.model):  # decided alike in every process
            raise not_finite(step, last_good(self.run_dir))
        if self.background is not None:  # (the save in flight may commit this same folder)
            self.background.wait()
        staged = staging_dir(target, gather_objects(os.getpid())[0])
        failure: Exception | None = None
        if self.world.is_main:
            try:
                begin_staging(staged)
            except OSError as err:
                failure = write_failure(target, err)
            except GlassloopError as err:  # a link in its place: refused
                failure = err
        self._agree(failure, target)
        if self.background is not None:  # (copied now, written in the background)
            self.background.write_shards(shards, staged / SHARDS, commits=self.world.is_main)
            return staged
        try:
            shards.save(staged / SHARDS)  # a collective: each process writes its own file
        except Exception as err:  # DCP reports any process's failure in every process
            if self.world.is_main:
                with contextlib.suppress(OSError):
                    remove_marked(staged)
            raise CheckpointWriteError(
                f"checkpoint: could not write the shards of '{target}': "
                f"{str(err).splitlines()[0][:300]}; nothing was lost"
            ) from err
        return staged

    def _agree(self, failure: Exception | None, path: Path) -> None:
        """Raise in every process when rank 0's write failed (its own error in rank 0)."""
        if self.world.distributed:
            failed = all_reduce(torch.tensor([float(failure is not None)]), "max").item()
            if failed and failure is None:
                raise CheckpointError(f"checkpoint: rank 0 could not write '{path}'; see its error")
        if failure is not None:
            raise failure

    def meta(self, *, finished: bool = False) -> dict[str, Any]:
        """meta.json of a checkpoint: where the run stands, its config, what ran it."""
        state, history, info = self.state, self.record.history, self.info
        return {
            "format": FORMAT_VERSION,
            "world_size": self.world.size,
            "step": state.step,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "global_batch": self.global_batch,
            "finished": finished,
            "train_s": round(state.train_seconds(), 3),  # (a resume goes on counting from it)
            "metrics": history[-1] if history else None,
            "config": info.config,
            "model_spec": info.model_spec,
            "versions": info.versions,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    # --------------------------------------------------------------------------- resume
    def resume(
        self,
        resume: str | Path | None,
        *,
        epochs: int,
        allow_config_change: bool = False,
        warn: Callable[[str], None] | None = None,
    ) -> Checkpoint | None:
        """Resume (``resume``: ``"auto"``, the newest valid checkpoint, or a path): find the
        checkpoint (:meth:`find`), check it fits (:mod:`glassloop.checkpoint.resume`), load
        the weights into the model (an FSDP run: its shards read them from the checkpoint's
        shards/ when the optimizer state loads), then the rest (:meth:`load_state_dict`),
        and say where the run goes on when it has ``epochs`` left. Without ``resume``, make
        sure a fresh run overwrites none. The checkpoint, or ``None``."""
        warn = warn if warn is not None else self.say
        if self.run_dir is not None and self.shards is None:
            self.base.take(self.model)  # the frozen base, before anything is loaded or trained
        if resume is None:
            self.refuse_overwrite()
            return None
        checkpoint = self.find(resume, warn)
        if checkpoint is None:
            return None
        sharded = self.shards is not None
        config = self.info.config
        changed = check_compatible(
            checkpoint,
            config,
            allow_config_change,
            warn,
            world=self.world,
            loader=self.loader,
            sharded=sharded,
        )
        if self.shards is not None:  # weights and optimizer come from shards/ with the state
            self.shards.source = checkpoint.path / SHARDS
        else:
            tensors, path = checkpoint.model_tensors, checkpoint.path
            # A fine-tuned run's base: the model's own, refused unless it is the one trained on
            base = self.base.check(self.model, checkpoint.meta.get("base"), set(tensors), path)
            load_checked(self.model, tensors, checkpoint.weights, base=base)  # (read once)
        with config_applied(changed, self.parts, self.record.history, self.policy):
            try:
                self.load_state_dict(checkpoint.state)
                self.state.train_s = float(checkpoint.meta.get("train_s") or 0.0)  # (older)
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                raise CheckpointError(
                    f"checkpoint: '{checkpoint.path}' does not fit this trainer: "
                    f"{type(err).__name__}: {err}"
                ) from err
        state = self.state
        if state.epoch < epochs and not state.stopped:
            caveat = replay_caveat(self.loader, state.batch_in_epoch)
            for line in [caveat] if caveat else []:
                warn(line)
            where = self.remote.shown_path(checkpoint.path) if self.remote else checkpoint.path
            warn(
                f"resumed from '{where}' at step {state.step} (epoch "
                f"{state.epoch + 1}, batch {state.batch_in_epoch})"
            )
        return checkpoint

    def refuse_overwrite(self) -> None:
        """A fresh run never writes over a run directory that holds checkpoints."""
        if self.run_dir is not None and step_dirs(self.run_dir):
            raise CheckpointError(
                f"checkpoint: '{self.run_dir}' already holds checkpoints; pass "
                "resume='auto' (--resume) to continue that run, or choose another run_dir"
            )

    def find(self, resume: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
        """The checkpoint to resume from: ``"auto"`` is the newest valid one in ``run_dir``
        (``None`` when there is none; an error when there are some and none is valid, so
        nothing a user may want to repair is overwritten); a path is read as is."""
        if str(resume) != "auto":
            return read_checkpoint(Path(resume), check_training_state, self.fits)  # as it is
        if self.run_dir is None:
            raise GlassloopError("resume='auto' needs a run_dir to look for checkpoints in")
        found, problems = find_resumable(self.run_dir, check_training_state, self.fits)
        if found is None and problems:
            raise CheckpointError(
                f"checkpoint: no valid checkpoint to resume in '{self.run_dir}' (nothing "
                f"was changed): {' | '.join(problems)}"
            )
        for problem in problems:
            warn(f"warning: {problem}; falling back to an older checkpoint")
        if found is None:
            warn(f"no checkpoint in '{self.run_dir / 'checkpoints'}'; starting at step 0")
        return found

    def fits(self, meta: Any, shapes: dict[str, tuple[list[int], str]], path: Path) -> None:
        """Raise a :class:`CheckpointError` (a resume passes over the checkpoint for an older
        one, as over a damaged one) when its weights (each key's ``shapes`` and dtype, from
        the file's header) do not fit the model (a fine-tuned run's base left out), though
        the config says it is the model they were saved from (a changed model or data
        section is :mod:`glassloop.checkpoint.resume`'s to say)."""
        changes = config_differences(meta.get("config"), self.info.config)
        if self.shards is not None or any(c.startswith(("model.", "data.")) for c in changes):
            return
        # (the base's keys as recorded: its digests are checked when it is loaded, a base of
        # another run being the model's, never a reason to take an older checkpoint)
        check_fit(self.model, shapes, path, recorded_names(meta.get("base")))

    def usable(self, path: Path) -> None:
        """Raise a :class:`CheckpointError` unless the checkpoint at ``path`` is one a resume
        takes (it verifies, its state makes sense, its weights fit): a remote run's pull
        takes the newest such one (:class:`glassloop.run_dir.remote.RemoteRun`), as a local resume
        does."""
        read_checkpoint(path, check_training_state, self.fits)
