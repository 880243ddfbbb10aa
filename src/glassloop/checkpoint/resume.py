"""The resume's checks: which config keys a resumed run may change (and which change what it
computes), and a training state's numbers that cannot be right, refused before any is used.
:class:`~glassloop.checkpoint.checkpointer.Checkpointer` calls them when it resumes."""

from __future__ import annotations

import json
from typing import Any

from glassloop.data.options import DataConfig
from glassloop.options import TrainConfig, resume_safe
from glassloop.rng import check_rng_state
from glassloop.storage.serialization import dotted, stable_repr

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
