"""The checkpoint policy: when to save, how many to keep, which one is best, and how to resume
with the checks that keep a resume honest. Storage (atomic files, verification, pruning)
is :mod:`glassloop.checkpoint`; this module decides, that one writes.

The Trainer hands it the model and one dict of every stateful part's ``state_dict()``
(:func:`state_of`, :meth:`glassloop.Trainer.state_dict`) and saves in one line; a resume is
one call too (:meth:`Checkpointer.restore`)::

    checkpointer = Checkpointer(run_dir, CheckpointConfig(every_n_steps=100, monitor="val_loss"))
    if checkpointer.due_after_step(step):
        checkpointer.save(model, trainer.state_dict(), checkpointer.meta(state, history, info))
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import glassloop.fsdp as fsdp
from glassloop.best import improves, monitor_mode
from glassloop.checkpoint import (
    BEST,
    FORMAT_VERSION,
    SHARDS,
    Checkpoint,
    CheckpointError,
    CheckpointWriteError,
    begin_staging,
    checkpoints_dir,
    find_resumable,
    latest_pointer,
    not_finite,
    prune,
    read_checkpoint,
    remove_marked,
    save_best,
    save_checkpoint,
    staging_dir,
    step_dir_name,
    step_dirs,
)
from glassloop.distributed import SINGLE, World, all_reduce, gather_objects
from glassloop.errors import ConfigError, GlassloopError, write_failure
from glassloop.fsdp import ShardedState
from glassloop.guards import NonFiniteWatch
from glassloop.metrics import is_number
from glassloop.rng import capture_rng_state, replay_caveat, restore_rng_state
from glassloop.run_log import RunInfo
from glassloop.serialization import dotted, stable_repr
from glassloop.state import EpochRecord, TrainState
from glassloop.weights import load_checked


def state_of(
    parts: Mapping[str, Any], record: EpochRecord, callbacks: Sequence[Any], loader: Any,
    world: World, watch: NonFiniteWatch | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything but the weights that an exact resume needs: each part's ``state_dict()``
    (``None``: not part of this run), the epoch's losses so far (every process's: a
    collective), the callbacks' states, the RNG, the loader's generators included (every
    process's: dropout masks differ per process; a collective), and with a loss-spike guard
    the losses its next steps are measured against (every process's own)."""
    rng = capture_rng_state(loader)
    state = {
        **{name: part.state_dict() if part is not None else None for name, part in parts.items()},
        **record.state_dict(world),
        "callbacks": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in callbacks],
        "rng": rng,
        "rng_per_rank": gather_objects(rng) if world.distributed else None,
    }
    if watch is not None and watch.spike:  # (absent otherwise: the format is unchanged)
        window = watch.state_dict()
        state["loss_spike"] = gather_objects(window) if world.distributed else [window]
    return state


def restore_state(
    state: dict[str, Any], parts: Mapping[str, Any], record: EpochRecord,
    callbacks: Sequence[Any], loader: Any, world: World, device: torch.device,
    watch: NonFiniteWatch | None = None,
) -> None:  # fmt: skip
    """:func:`state_of` back into the parts; the global RNGs last, right before training goes
    on. A part the state lacks is a ``KeyError`` (reported as "does not fit")."""
    for name, part in parts.items():
        saved = state[name]
        if part is not None and saved is not None:
            part.load_state_dict(saved)
    record.load_state_dict(state, device, world)
    # The loss-spike windows, each process its own. None: written without the guard or
    # before it; written by another number of processes (a resharded FSDP resume): the new
    # processes start fresh windows, as every resume did before.
    windows = state.get("loss_spike") or []
    if watch is not None and watch.spike and len(windows) == world.size:
        watch.load_state_dict(windows[world.rank])
    for callback, saved in zip(callbacks, state["callbacks"], strict=False):
        if saved is not None and hasattr(callback, "load_state_dict"):
            callback.load_state_dict(saved)
    per_rank = state.get("rng_per_rank") or []
    # (A resharded FSDP resume has another number of processes: rank 0's RNG for all.)
    same_world = len(per_rank) == world.size
    restore_rng_state(per_rank[world.rank] if same_world else state["rng"], loader)


@dataclass
class CheckpointConfig:
    """When to save (``every_n_steps``, ``every_n_epochs``; always at the end), how many to
    keep, and which validation metric picks ``RUN_DIR/best/`` (``""``: no best tracking)."""

    every_n_steps: int = 0  # 0: off
    every_n_epochs: int = 1  # 0: off
    keep_last: int = 3
    monitor: str = ""  # e.g. "val_loss" or "val_accuracy"
    mode: str = "auto"  # "min", "max", or "auto" (max for accuracy/F1, else min)


class Checkpointer:
    """Saves and restores a run's checkpoints under ``run_dir`` (does nothing without one).

    Every process calls :meth:`save` (the state holds every process's RNG); rank 0 writes and
    the others wait for its verdict, so a failed write fails every process.
    """

    def __init__(
        self, run_dir: Path | None, policy: CheckpointConfig | None = None, *, world: World = SINGLE
    ) -> None:
        self.run_dir = run_dir
        self.policy = policy if policy is not None else CheckpointConfig()
        self.world = world

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
        self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any],
        shards: ShardedState | None = None,
    ) -> Path | None:  # fmt: skip
        """Commit ``checkpoints/step-<step>/`` and prune to ``keep_last``; the path (None
        without a run directory). ``shards``: an FSDP run's weights and optimizer state,
        written by every process into the checkpoint before rank 0 commits it."""
        if self.run_dir is None:
            return None
        path = checkpoints_dir(self.run_dir) / step_dir_name(int(meta["step"]))
        staged = self._stage(path, shards, int(meta["step"])) if shards is not None else None
        failure: Exception | None = None
        if self.world.is_main:  # one writer; the others wait for its verdict below
            try:
                weights = model if shards is None else None
                path = save_checkpoint(self.run_dir, weights, state, meta, staged=staged)
                prune(self.run_dir, self.policy.keep_last)
            except GlassloopError as err:
                failure = err
        self._agree(failure, path)
        return path

    def save_best(
        self, model: nn.Module, state: dict[str, Any], meta: dict[str, Any],
        shards: ShardedState | None = None,
    ) -> None:  # fmt: skip
        """``RUN_DIR/best/`` (rank 0 commits; the state was gathered by every process, and
        every process writes its shards of an FSDP run)."""
        if self.run_dir is None:
            return
        target = self.run_dir / BEST
        staged = self._stage(target, shards, int(meta["step"])) if shards is not None else None
        failure: Exception | None = None
        if self.world.is_main:
            try:
                save_best(
                    self.run_dir, model if shards is None else None, state, meta, staged=staged
                )
            except GlassloopError as err:
                failure = err
        self._agree(failure, target)

    def _stage(self, target: Path, shards: ShardedState, step: int) -> Path:
        """Every process writes its part of the weights and optimizer state into the staging
        directory of ``target`` (named by rank 0's pid); rank 0 then commits it whole."""
        assert self.run_dir is not None
        if not fsdp.all_finite(shards.model):  # decided alike in every process
            last = latest_pointer(self.run_dir)
            raise not_finite(step, str(last) if last is not None else "none")
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

    def meta(
        self, state: TrainState, history: list[dict[str, Any]], info: RunInfo, *,
        finished: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """meta.json of a checkpoint: where the run stands, its config, what ran it."""
        return {
            "format": FORMAT_VERSION, "world_size": self.world.size, "step": state.step,
            "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
            "finished": finished, "metrics": history[-1] if history else None,
            "config": info.config, "model_spec": info.model_spec, "versions": info.versions,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }  # fmt: skip

    # --------------------------------------------------------------------------- restore
    def restore(
        self, resume: str | Path, model: nn.Module, load_state: Callable[[dict[str, Any]], None],
        *, config: Any, allow_config_change: bool, warn: Callable[[str], None],
        shards: ShardedState | None = None,
    ) -> Checkpoint | None:  # fmt: skip
        """Resume: find the checkpoint (:meth:`find`), check it fits (:meth:`check_compatible`),
        load the weights into ``model`` (an FSDP run: ``shards`` read them from the
        checkpoint's shards/ when the optimizer state loads), then ``load_state`` the rest
        (:func:`restore_state`). The checkpoint, or ``None`` when there is none to resume."""
        checkpoint = self.find(resume, warn)
        if checkpoint is None:
            return None
        sharded = shards is not None
        self.check_compatible(checkpoint, config, allow_config_change, warn, sharded=sharded)
        if shards is not None:  # weights and optimizer come from shards/ with the state
            shards.source = checkpoint.path / SHARDS
        else:
            load_checked(model, checkpoint.model_tensors, checkpoint.weights)  # read once
        try:
            load_state(checkpoint.state)
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(
                f"checkpoint: '{checkpoint.path}' does not fit this trainer: "
                f"{type(err).__name__}: {err}"
            ) from err
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
            return read_checkpoint(Path(resume))  # named explicitly: no fallback
        if self.run_dir is None:
            raise GlassloopError("resume='auto' needs a run_dir to look for checkpoints in")
        found, problems = find_resumable(self.run_dir)
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

    def check_compatible(
        self,
        checkpoint: Checkpoint,
        config: Any,
        allow_config_change: bool,
        warn: Callable[[str], None] = print,
        *,
        sharded: bool = False,
    ) -> None:
        """The same number of processes (each one's data shard and RNG are in the state) and
        the same config, but for keys that do not change the result. Keys the checkpoint's
        config does not have (settings added by a newer glassloop) cannot be compared: they
        are named in a warning instead, so an upgrade never blocks a resume.

        ``sharded`` (an FSDP run): the checkpoint must be sharded too, and may come from
        another number of processes (DCP reshards it), with a warning saying what changes."""
        if checkpoint.sharded != sharded:
            raise ConfigError(
                f"config: '{checkpoint.path}' was written by an FSDP run; resume it with "
                "train.strategy = 'fsdp' (any number of processes)"
                if checkpoint.sharded
                else f"config: '{checkpoint.path}' was written without FSDP; train.strategy "
                "= 'fsdp' resumes only FSDP checkpoints: resume with the strategy it was "
                "written with (its weights start an FSDP run: glassloop.load_weights)"
            )
        saved_world = checkpoint.meta.get("world_size", 1)  # checked to be an int >= 1
        if saved_world != self.world.size and sharded:
            warn(
                f"resharding '{checkpoint.path}' from {saved_world} to {self.world.size} "
                "process(es): the weights and the optimizer state are resharded exactly; "
                "each process's data shard and RNG differ from the saved run's, so the run "
                "goes on from the same point but not bit for bit as it would have (keep "
                "data.batch_size x processes the same to keep the global batch)"
            )
        elif saved_world != self.world.size:
            raise ConfigError(
                f"config: '{checkpoint.path}' was written by {saved_world} process(es), this "
                f"job has {self.world.size}; resume with the same number (--nproc "
                f"{saved_world}): each process's data shard and RNG are part of the state"
            )
        changes = config_differences(checkpoint.meta.get("config"), config)
        newer = [change for change in changes if ": <unset> -> " in change]
        if newer:
            warn(
                f"warning: '{checkpoint.path}' was written before these settings existed, so "
                f"they are not compared: {'; '.join(newer)}"
            )
            changes = [change for change in changes if change not in newer]
        if changes and not allow_config_change:
            raise ConfigError(
                f"config: the run in '{checkpoint.path}' was made with a different config: "
                f"{'; '.join(changes)}. Resuming would not continue the same run; pass "
                "--allow-config-change (allow_config_change=True) to resume anyway"
            )


# Keys a resumed run may change without changing what it computes.
RESUME_SAFE_KEYS = (
    "train.epochs",
    "train.log_every",
    "train.progress",
    "train.device",
    "data.num_workers",
    "data.eval_batch_size",
    "train.compile",
    "train.compile_mode",
    "train.compile_dynamic",
    # the same, in the description of a run built in Python
    "compile",
    "device",
)
# Keys that build() fills in from train.epochs when the user leaves them out: a change of
# epochs shows up as a change of these, and the message names the key the user changed.
DERIVED_FROM_EPOCHS = ("scheduler.T_max", "scheduler.total_steps")
RESUME_SAFE_PREFIXES = ("checkpoint.", "tracking.")


def config_differences(saved: Any, current: Any) -> list[str]:
    """``key: saved -> current`` for every key that differs, except keys that do not change
    the trajectory (logging, device, workers, epochs to run, compile, checkpoint policy).

    >>> config_differences({"optim": {"lr": 0.1}}, {"optim": {"lr": 0.2}})
    ['optim.lr: 0.1 -> 0.2']
    """
    old = dotted(json.loads(json.dumps(saved, default=stable_repr)))
    new = dotted(json.loads(json.dumps(current, default=stable_repr)))
    epochs = f"train.epochs: {old.get('train.epochs')} -> {new.get('train.epochs')}"
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if key in RESUME_SAFE_KEYS or key.startswith(RESUME_SAFE_PREFIXES):
            continue
        change = f"{key}: {old.get(key, '<unset>')} -> {new.get(key, '<unset>')}"
        if old.get(key, "<unset>") == new.get(key, "<unset>"):
            continue
        if key in DERIVED_FROM_EPOCHS and old.get("train.epochs") != new.get("train.epochs"):
            change = f"{epochs} (the learning-rate schedule spans the run: {change})"
        changes.append(change)
    return changes


def resumed_messages(checkpoint: Checkpoint, state: TrainState, loader: Any) -> list[str]:
    """What a resume says: where it goes on and, for a loader whose position is replayed,
    what that replay cannot promise (:func:`glassloop.rng.replay_caveat`)."""
    caveat = replay_caveat(loader, state.batch_in_epoch)
    where = (
        f"resumed from '{checkpoint.path}' at step {state.step} (epoch {state.epoch + 1}, "
        f"batch {state.batch_in_epoch})"
    )
    return [caveat, where] if caveat else [where]
