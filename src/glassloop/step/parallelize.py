"""How the model runs: activation checkpointing inside the user's module, ``torch.compile``
around it, then DDP or FSDP2 around that when several processes train it (torchtitan's
``parallelize`` step, for one model).

:func:`prepare_model` is what the Trainer does with a model before the first step;
:func:`glassloop.distributed.world.unwrap_model` takes the wrappers off again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

import glassloop.distributed.fsdp as fsdp
from glassloop.device import resolve_device
from glassloop.distributed.fsdp import ShardedState
from glassloop.distributed.world import (
    World,
    check_strategy,
    init_from_env,
    local_device,
    unwrap_model,
    wrap,
)
from glassloop.errors import ConfigError
from glassloop.step.optim import Optimizers


def place(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: str | torch.device,
    world: World | None,
    strategy: str,
    checkpointed: Sequence[str] = (),
    *,
    precision: str,
    compile: Mapping[str, Any] | None,
    ema: bool,
) -> tuple[World, torch.device, nn.Module, ShardedState | None]:
    """Where a run runs: its processes (``world``, or torchrun's: their process group
    joined), this process's device (``"auto"``: a GPU when there is one; under torchrun its
    own), and ``model`` on it as :func:`prepare_model` makes it."""
    resolved = resolve_device(device)
    world = world or init_from_env(resolved, strategy=strategy)
    here = local_device(resolved, world)
    options: dict[str, Any] = {"precision": precision, "compile": compile, "ema": ema}
    prepared, sharded = prepare_model(
        model, optimizer, world, here, strategy=strategy, checkpointed=checkpointed, **options
    )
    return world, here, prepared, sharded


def prepare_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    world: World,
    device: torch.device,
    *,
    strategy: str,
    precision: str,
    compile: Mapping[str, Any] | None,
    ema: bool,
    checkpointed: Sequence[str] = (),
) -> tuple[nn.Module, ShardedState | None]:
    """``model`` on ``device``, compiled when asked, under DDP or FSDP2 in a multi-process
    job; with ``strategy="fsdp"`` also the :class:`~glassloop.distributed.fsdp.ShardedState`
    (weights and optimizer state by shard) that checkpoints save instead of the plain state dicts.
    ``compile``: ``torch.compile``'s ``mode`` and ``dynamic`` (``None``: not compiled)."""
    check_strategy(strategy)  # (also when the world was given)
    model = model.to(device)
    if checkpointed:  # (before FSDP: a unit's recomputation runs inside the unit, between
        # its pre-backward all-gather and its reshard, as torchtitan's wrapper does)
        checkpoint_activations(model, checkpointed)
    # torch.compile wraps the module (state_dict keys gain "_orig_mod."); checkpoints store
    # the unwrapped keys, so they load with or without compile. dynamic=False: one static
    # graph per input shape. Dynamo's default ("automatic dynamic") switches to a dynamic
    # graph after the second shape it sees (the short last batch), so which kernels run
    # depends on the order a process met the shapes in, which a resumed process does not
    # repeat (a max weight diff of 0.018 was reported on a resume).
    if compile is not None:
        model = cast(nn.Module, torch.compile(model, **compile))
    if strategy != "fsdp":
        # Several processes: DistributedDataParallel (gradients averaged across them during
        # backward, once per optimizer step: see fsdp.gradient_sync).
        return wrap(model, world, device), None
    # FSDP2: parameters, gradients and optimizer state sharded; the optimizer is pointed at
    # the sharded parameters (glassloop.distributed.fsdp).
    fsdp.check_options(precision=precision, ema=ema, compile=compile is not None)
    if isinstance(optimizer, Optimizers):
        raise ConfigError(
            "config: train.strategy = 'fsdp' takes one optimizer (its state is sharded with "
            "the model's); several optimizers train with 'ddp'"
        )
    if world.distributed:
        model = fsdp.shard_model(model, optimizer, world, device, precision)
    return model, ShardedState(model, optimizer)


def evaluated(model: nn.Module, ema: AveragedModel | None) -> nn.Module:
    """What a trainer evaluates and exports: the EMA of the weights when there is one, else
    the model (under DDP its module: evaluation needs no gradient sync)."""
    if ema is not None:
        return ema.module
    return model.module if isinstance(model, DDP) else model


def averaged(model: nn.Module, decay: float) -> AveragedModel:
    """An exponential moving average of ``model``'s weights and buffers (torch's
    ``AveragedModel``): what is evaluated and exported when ``ema_decay`` is set."""
    average = get_ema_multi_avg_fn(decay)  # type: ignore[no-untyped-call]
    return AveragedModel(unwrap_model(model), multi_avg_fn=average, use_buffers=True)


def checkpoint_activations(model: nn.Module, class_names: Sequence[str]) -> list[str]:
    """Recompute, during backward, the activations of every submodule whose class is named
    in ``class_names`` (e.g. ``["TransformerBlock"]``) instead of keeping them from the
    forward pass: less memory for one more forward of those modules. Each one's ``forward``
    runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant; the RNG is replayed, so
    dropout masks are the same): the gradients, and so the weights, are bitwise those
    without it, and state_dict keys do not change. A name that matches no submodule is an
    error naming the classes there are. Returns the checkpointed modules' names."""
    classes = {type(module).__name__ for module in model.modules()}
    unknown = sorted(set(class_names) - classes)
    if unknown:
        raise ConfigError(
            f"config: train.activation_checkpointing names {unknown}, which are not module "
            f"classes of this model (it has: {', '.join(sorted(classes))})"
        )
    done = []
    for name, module in model.named_modules():
        if type(module).__name__ in class_names:
            module.forward = functools.partial(_checkpointed, module.forward)
            done.append(name)
    return done


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
