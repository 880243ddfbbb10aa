"""Optimizers and learning-rate schedulers by name: any ``torch.optim`` class and any
``torch.optim.lr_scheduler`` class (plus the built-in ``warmup_cosine``), their keyword
arguments checked against the class's signature, and building them for a model."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from glassloop.config.schedules import warmup_cosine
from glassloop.config.sections import OptimConfig, SchedulerConfig
from glassloop.errors import ConfigError
from glassloop.rules import (
    AT_LEAST_0,
    AT_LEAST_1,
    Range,
    check_range,
    check_type,
    suggest,
    unknown_key,
)
from glassloop.step.optim import needs_closure

# Optimizer arguments that choose a kernel, not the mathematics; not recorded as defaults.
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
# The keys of [optim] and [scheduler] that are glassloop's, not the class's.
OWN_KEYS = {"optim": ["name", "lr", "no_decay_bias_norm"], "scheduler": ["name", "interval"]}
# Scheduler arguments that are lengths or periods: 0 divides by zero inside torch.
SCHEDULER_LENGTHS = ("T_max", "T_0", "T_mult", "step_size", "total_iters", "total_steps")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = [
            n
            for n in dir(torch.optim)
            if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and n != "Optimizer"
        ]
        guess = suggest(name, names)
        hint = f" (did you mean '{guess}'?)" if guess else ""
        raise ConfigError(f"config: optim.name {name!r} is not a torch.optim optimizer{hint}")
    return cls


def scheduler_class(name: str) -> type:
    sched = torch.optim.lr_scheduler
    cls = getattr(sched, name, None)
    base = (sched.LRScheduler, sched.ReduceLROnPlateau)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        names = [
            n
            for n in dir(sched)
            if isinstance(getattr(sched, n), type) and issubclass(getattr(sched, n), base)
        ]
        guess = suggest(name, names)
        hint = f" (did you mean '{guess}'?)" if guess else ""
        raise ConfigError(
            f"config: scheduler.name {name!r} is not a torch.optim.lr_scheduler class{hint} "
            "(use 'none' for no scheduler)"
        )
    return cls


def checked_kwargs(
    section: str, cls: type, kwargs: dict[str, Any], reserved: tuple[str, ...]
) -> dict[str, Any]:
    """Check ``kwargs`` against ``cls.__init__``'s signature: names and basic types."""
    params = inspect.signature(cls).parameters
    allowed = [p for p in params if p not in ("self", *reserved) and not p.startswith("_")]
    own = OWN_KEYS[section]
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in allowed:
            raise unknown_key(section, key, allowed + own, cls.__name__)
        default = params[key].default
        if key in SCHEDULER_LENGTHS:
            value = check_type(f"{section}.{key}", value, int)
            check_range(f"{section}.{key}", value, AT_LEAST_1)
        elif isinstance(default, bool):
            value = check_type(f"{section}.{key}", value, bool)
        elif isinstance(default, (int, float)):  # SGD's momentum defaults to int 0
            value = check_type(f"{section}.{key}", value, float)
            value = int(value) if isinstance(default, int) and value.is_integer() else value
        elif isinstance(default, tuple):
            numbers = all(isinstance(v, (int, float)) for v in default)
            if not isinstance(value, list) or (numbers and len(value) != len(default)):
                shape = f"a list of {len(default)} numbers" if numbers else "a list"
                raise ConfigError(f"config: {section}.{key} must be {shape}, got {value!r}")
            value = tuple(
                check_type(f"{section}.{key}[{i}]", v, float) if numbers else v
                for i, v in enumerate(value)
            )
        out[key] = value
    return out


def optimizer_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The checked keyword arguments, with the optimizer's own numeric defaults filled in so
    that the resolved config records e.g. AdamW's ``weight_decay = 0.01`` explicitly."""
    cls = optimizer_class(name)
    checked = checked_kwargs("optim", cls, kwargs, ("params", "lr"))
    defaults = {
        key: param.default
        for key, param in inspect.signature(cls).parameters.items()
        if key not in ("self", "params", "lr", *IMPLEMENTATION_FLAGS)
        and isinstance(param.default, (bool, int, float, tuple))
    }
    merged = {**defaults, **checked}
    try:  # its own checks (betas in [0, 1), eps >= 0, ...), before any data is read
        dry_step(cls, merged)
    except (TypeError, ValueError, IndexError, RuntimeError, AssertionError) as err:
        given = ", ".join(f"{key}={value!r}" for key, value in checked.items())
        raise ConfigError(
            f"config: optim: {cls.__name__} refuses these arguments ({given}): "
            f"{type(err).__name__}: {' '.join(str(err).split()).rstrip('.')}"
        ) from err
    return merged


def dry_step(cls: Any, kwargs: dict[str, Any]) -> None:
    """Build ``cls`` over one number and take a step: what its constructor refuses, and what
    only its step does (LBFGS's ``history_size = 0``, ``differentiable = true`` on a leaf).
    ``capturable``/``fused`` choose a device's kernel: stepped where the device is known."""
    probe = torch.ones(1, requires_grad=True)
    optimizer = cls([probe], lr=1e-3, **kwargs)
    if kwargs.get("capturable") or kwargs.get("fused"):
        return

    def closure() -> torch.Tensor:  # (called again by LBFGS's line search and iterations)
        optimizer.zero_grad()
        loss = (probe * probe).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    closure()
    optimizer.step(closure) if needs_closure(optimizer) else optimizer.step()


WARMUP_COSINE_KEYS = {"warmup_steps": int, "min_lr_ratio": float, "total_steps": int}


def scheduler_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    if name == "warmup_cosine":
        out = {"warmup_steps": 0, "min_lr_ratio": 0.0}
        for key, value in kwargs.items():
            if key not in WARMUP_COSINE_KEYS:
                raise unknown_key(
                    "scheduler", key, [*WARMUP_COSINE_KEYS, "name", "interval"], "warmup_cosine"
                )
            out[key] = check_type(f"scheduler.{key}", value, WARMUP_COSINE_KEYS[key])
        check_range("scheduler.warmup_steps", out["warmup_steps"], AT_LEAST_0)
        check_range("scheduler.min_lr_ratio", out["min_lr_ratio"], Range(0.0, 1.0))
        if "total_steps" in out:
            check_range("scheduler.total_steps", out["total_steps"], AT_LEAST_1)
        return out
    if name.lower() == "none":
        if kwargs:
            raise ConfigError(
                f"config: scheduler.name is 'none' but scheduler.{next(iter(kwargs))} is set"
            )
        return {}
    return checked_kwargs("scheduler", scheduler_class(name), kwargs, ("optimizer",))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights of dimension >= 2 with ``weight_decay``; biases and normalisation
    weights (1-D) without, since decaying them only hurts. Frozen parameters are included
    (the optimizer skips them while they have no gradient), so unfreezing them later trains
    them, as with ``optimizer(model.parameters())``."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """The ``[optim]`` section's optimizer over ``model``'s parameters."""
    cls: Any = optimizer_class(optim.name)  # a concrete subclass: it takes lr
    params: Any = model.parameters()
    if optim.no_decay_bias_norm:
        params = parameter_groups(model, float(optim.kwargs.get("weight_decay", 0.0)))
    try:
        optimizer: torch.optim.Optimizer = cls(params, lr=optim.lr, **optim.kwargs)
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise ConfigError(f"config: optim: {cls.__name__} rejected its arguments: {err}") from err
    return optimizer


def schedule_span(scheduler: SchedulerConfig, epochs: int, steps_per_epoch: int) -> dict[str, int]:
    """The length a scheduler gets when the user leaves it out: the whole run
    (``CosineAnnealingLR``'s ``T_max`` in epochs or steps, ``warmup_cosine``'s
    ``total_steps``). Recorded in the run's resolved config."""
    if scheduler.name == "warmup_cosine" and "total_steps" not in scheduler.kwargs:
        return {"total_steps": epochs * steps_per_epoch}
    if scheduler.name == "CosineAnnealingLR" and "T_max" not in scheduler.kwargs:
        per = steps_per_epoch if scheduler.interval == "step" else 1
        return {"T_max": epochs * per}
    return {}


def build_scheduler(
    optimizer: torch.optim.Optimizer, scheduler: SchedulerConfig, span: dict[str, int]
) -> Any:
    """The ``[scheduler]`` section's scheduler (``None`` for ``"none"``), with ``span`` (see
    :func:`schedule_span`) filled in."""
    name = scheduler.name
    if name.lower() == "none":
        return None
    kwargs = {**scheduler.kwargs, **span}
    if name == "warmup_cosine":
        return warmup_cosine(optimizer, **kwargs)
    cls = scheduler_class(name)
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError, ArithmeticError, IndexError, RuntimeError) as err:
        raise ConfigError(f"config: scheduler: {name} rejected its arguments: {err}") from err
