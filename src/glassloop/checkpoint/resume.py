"""The resume's checks: which config keys a resumed run may change (and which change what it
computes), whether a checkpoint fits the run resuming it, and a training state's numbers
that cannot be right, refused before any is used.
:class:`~glassloop.checkpoint.checkpointer.Checkpointer` calls them when it resumes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from glassloop.best import improves, monitor_mode
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
# Keys no resume changes, --allow-config-change or not: what they set is the checkpoint's
# state itself, which the new value could only be recorded beside, never used.
FIXED_ON_RESUME = {
    "optim.name": "the optimizer's state (its moments and counts) is the old class's",
    "optim.no_decay_bias_norm": "the optimizer's parameter groups are the checkpoint's",
    "scheduler.name": "the schedule's state is the old class's",
    "scheduler.interval": "the schedule's count is in the old unit",
    "train.seed": "a resume goes on with the random streams it saved; the seed only starts them",
}


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
) -> list[str]:
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
    # (a schedule's length a change of epochs moved: the schedule's key, applied)
    keys = [change.rpartition("spans the run: ")[2].split(":")[0] for change in changes]
    # (the checkpoint policy may change freely, but the best so far is the old monitor's)
    saved, now = checkpoint.meta.get("config") or {}, config or {}
    old, new = saved.get("checkpoint") or {}, now.get("checkpoint") or {}
    keys += [f"checkpoint.{key}" for key in ("monitor", "mode") if old.get(key) != new.get(key)]
    for key in keys:
        if key in FIXED_ON_RESUME:
            raise ConfigError(
                f"config: {key} cannot change on resume, --allow-config-change or not: "
                f"{FIXED_ON_RESUME[key]}; resume with its old value, or start a new run from "
                "the weights (glassloop.load_weights)"
            )
    return keys


@contextlib.contextmanager
def config_applied(
    changed: list[str], parts: dict[str, Any], history: list[dict[str, Any]], policy: Any
) -> Iterator[None]:
    """Around the load of a checkpoint's state: the keys ``--allow-config-change`` let
    change (``changed``, from :func:`check_compatible`) that the state would restore over
    the new config are set from the new config again, so that a change is used, never only
    recorded. ``optim.X``: each parameter group's ``X`` as the new optimizer has it (its
    moments and counts stay the checkpoint's). ``optim.lr`` and ``scheduler.X`` (``T_max``
    when a change of epochs moved it too): the schedule's new numbers, and the rate at its
    step from its formula (a schedule with none but its own recursion: an ``lr`` scales the
    rate it is at by new / old, any other change is refused). ``checkpoint.monitor`` /
    ``mode``: the best so far is the new monitor's, over the rows of the epochs done."""
    optimizer, scheduler, loop = parts.get("optimizer"), parts.get("scheduler"), parts["loop"]
    optimizer = getattr(optimizer, "optimizer", optimizer)  # (FSDP's ShardedState holds it)
    groups = [dict(group) for group in optimizer.param_groups] if optimizer else []
    fresh = scheduler.state_dict() if scheduler is not None else {}
    numbers = ((fresh.get("lr_lambdas") or [None])[0] or {}) | fresh  # (warmup_cosine's)
    hyper = {key.removeprefix("optim.") for key in changed if key.startswith("optim.")}
    schedule = [key.removeprefix("scheduler.") for key in changed if key.startswith("scheduler.")]
    kept = [f"optim.{name}" for name in hyper if groups and name not in groups[0]]
    kept += [f"scheduler.{name}" for name in schedule if name not in numbers]
    if schedule and rates_now(scheduler) is None:  # (its rate now: only its recursion knows)
        kept += [f"scheduler.{name}" for name in schedule]
    if kept:
        raise ConfigError(
            f"config: {', '.join(sorted(set(kept)))} cannot change on resume: the "
            "checkpoint's state holds what it set; resume with the old value, or start a new "
            "run from the weights (glassloop.load_weights)"
        )
    yield
    for group, new in zip(optimizer.param_groups if optimizer else [], groups, strict=True):
        for name in hyper & (new.keys() - {"params", "lr", "initial_lr"}):
            group[name] = new[name]
        base = "initial_lr" if "initial_lr" in new else "lr"  # (a schedule's base rate)
        if "lr" in hyper and base == "initial_lr":  # (the rate now, scaled: below, by formula)
            group["lr"] *= new[base] / group[base]
        if "lr" in hyper:
            group[base] = new[base]
    if scheduler is not None and optimizer is not None and (schedule or "lr" in hyper):
        for name in schedule:
            if name in fresh:
                setattr(scheduler, name, fresh[name])
            else:
                for saved, values in zip(scheduler.lr_lambdas, fresh["lr_lambdas"], strict=True):
                    vars(saved)[name] = values[name]
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, rate in zip(optimizer.param_groups, rates_now(scheduler) or [], strict=False):
            group["lr"] = rate
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if {"checkpoint.monitor", "checkpoint.mode"} & set(changed):
        loop.best_metric = None
        for value in (row[policy.monitor] for row in history if policy.monitor in row):
            if improves(float(value), loop.best_metric, monitor_mode(policy.monitor, policy.mode)):
                loop.best_metric = float(value)


def rates_now(scheduler: Any) -> list[float] | None:
    """The rates a schedule gives at its step, from its formula: ``LambdaLR``'s, or the
    closed form torch's schedules keep beside their recursion; ``None``: it has none."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        pairs = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        return [float(base * rate(scheduler.last_epoch)) for base, rate in pairs]
    closed = getattr(scheduler, "_get_closed_form_lr", None)
    return list(closed()) if callable(closed) else None
