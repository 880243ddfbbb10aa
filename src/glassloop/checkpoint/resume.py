"""The resume's checks: which config keys a resumed run may change (and which change what it
computes), whether a checkpoint fits the run resuming it, and a training state's numbers
that cannot be right, refused before any is used.
:class:`~glassloop.checkpoint.checkpointer.Checkpointer` calls them when it resumes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from glassloop.data.options import DataConfig
from glassloop.data.position import resized_note
from glassloop.distributed.world import SINGLE, World
from glassloop.errors import ConfigError
from glassloop.options import TrainConfig, resume_safe
from glassloop.rng import check_rng_state
from glassloop.storage.serialization import dotted, stable_repr

if TYPE_CHECKING:
    from glassloop.run_dir.checkpoints import Checkpoint

# Keys a resumed run may change without changing what it computes: the options marked so
# (glassloop.options), by their config key and, for a run built in Python, by their name.
RESUME_SAFE_KEYS = (
    *(f"train.{name}" for name in resume_safe(TrainConfig)),
    *(f"data.{name}" for name in resume_safe(DataConfig)),
    *resume_safe(TrainConfig),
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


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class MalformedState(ValueError):
    """A field of meta.json or the training state that cannot be right."""


def check_training_state(meta: Any, state: Any) -> None:
    """Refuse numbers that cannot be right before any of them is used (storage calls it on
    each checkpoint it reads for a resume): counters that are not non-negative integers, a
    world size that is not a positive integer, RNG states that the generators would reject
    (tried on throwaway generators)."""
    if not isinstance(meta, dict) or not isinstance(state, dict):
        raise MalformedState("meta.json and state.json must hold tables")
    for key in ("step", "epoch", "batch_in_epoch", "world_size"):
        if key in meta or key in ("step", "epoch"):
            minimum = 1 if key == "world_size" else 0
            if not _count(meta.get(key)) or meta[key] < minimum:
                raise MalformedState(f"meta.json {key} = {meta.get(key)!r}")
    batch = meta.get("global_batch")
    if batch is not None and (not _count(batch) or batch < 1):
        raise MalformedState(f"meta.json global_batch = {batch!r}")
    if not isinstance(meta.get("finished", False), bool):
        raise MalformedState(f"meta.json finished = {meta['finished']!r}")
    loop = state["loop"]
    for key in ("step", "epoch", "batch_in_epoch", "samples_seen"):
        if not _count(loop[key]):
            raise MalformedState(f"loop.{key} = {loop[key]!r}")
    if loop["step"] != meta["step"]:
        raise MalformedState(f"loop.step {loop['step']} != meta.json step {meta['step']}")
    best = loop.get("best_metric")
    if best is not None and not isinstance(best, (int, float)):
        raise MalformedState(f"loop.best_metric = {best!r}")
    if loop.get("validation_due", "") not in ("", "step", "epoch"):
        raise MalformedState(f"loop.validation_due = {loop['validation_due']!r}")
    ranks = state.get("rng_per_rank")
    for rng in [state["rng"], *(ranks or [])]:
        check_rng_state(rng)
    if ranks is not None and len(ranks) != meta.get("world_size", 1):
        raise MalformedState(f"{len(ranks)} RNG states for world_size {meta.get('world_size')}")
    data = state.get("data")
    if data is not None and not isinstance(data, dict):
        raise MalformedState("data position is not a table")
    if not isinstance(state.get("history", []), list):
        raise MalformedState("history is not a list")


def check_compatible(
    checkpoint: Checkpoint,
    config: Any,
    allow_config_change: bool,
    warn: Callable[[str], None] = print,
    *,
    world: World = SINGLE,
    loader: Any = None,
    sharded: bool = False,
) -> None:
    """The same config, but for keys that do not change the result; another number of
    processes is said in one line (what it keeps and what changes: :func:`glassloop.data.
    position.resized_note`). Keys the checkpoint's
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
    saved_batch = checkpoint.meta.get("global_batch")
    if saved_world != world.size and saved_batch is None and not sharded:
        raise ConfigError(
            f"config: '{checkpoint.path}' was written by {saved_world} process(es), this "
            f"job has {world.size}, and by a glassloop that did not record its "
            f"global batch; resume with the same number (--nproc {saved_world})"
        )
    if saved_world != world.size:
        data = checkpoint.state.get("data")
        note = resized_note(loader, world, saved_batch, data, sharded=sharded)
        warn(f"resuming '{checkpoint.path}' (written by {saved_world} process(es)) {note}")
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
            f"{'; '.join(changes)}. Resuming would not continue the same run: resume "
            "with the config it was made with (glassloop train --run-dir DIR --resume "
            "reads the run's own config.json), or change it on purpose with "
            "--allow-config-change (allow_config_change=True)"
        )
