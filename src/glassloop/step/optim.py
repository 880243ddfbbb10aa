"""The optimizers and schedulers a step drives, as the loop meets them: one optimizer or
several by name (a GAN's, :class:`Optimizers`) and their schedulers (:class:`Schedulers`), an
optimizer whose ``step`` takes a closure (LBFGS), the parameters it steps, its kernels on
the device, and an epoch's scheduler step. Building them by name from a config is
:mod:`glassloop.config.optimizers`'."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch

from glassloop.errors import ConfigError


def step_per_epoch(scheduler: Any, row: Mapping[str, Any]) -> None:
    """An epoch's scheduler step: ``ReduceLROnPlateau`` (and several by name, which hand it
    on) on the row's ``val_loss`` (``train_loss`` without validation), any other as is.

    After an optimizer step (the row's ``step`` over 0), torch's "``lr_scheduler.step()``
    before ``optimizer.step()``" warning is wrong and not shown: a run resumed from its first
    epoch's last step, whose checkpoint came before that epoch's scheduler step, steps the
    scheduler first in its new process, the optimizer having stepped in the one before."""
    with warnings.catch_warnings():
        if row["step"] > 0:
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
        if isinstance(scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, Schedulers)):
            scheduler.step(row.get("val_loss", row["train_loss"]))
        else:
            scheduler.step()


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` must be given a closure that re-evaluates the loss
    (``torch.optim.LBFGS``): its ``closure`` argument has no default."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError, AttributeError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def closure_step(
    optimizer: Any, precision: str, clipping: bool, nonfinite: str, processes: int
) -> bool:
    """Whether ``optimizer`` steps with a closure (:func:`needs_closure`), checked against
    what such a step (LBFGS: it calls forward, loss and backward itself, several times)
    supports, each refusal in one line. Gradient accumulation is defined: each evaluation
    covers the whole window."""
    if not needs_closure(optimizer):
        return False
    refused = [
        (
            precision == "fp16",
            "train.precision = 'fp16' (GradScaler cannot scale a closure's losses; use 'bf16' "
            "or '32')",
        ),
        (
            clipping,
            "gradient clipping (it would change the gradients the optimizer's own line search "
            "and curvature estimates rely on)",
        ),
        (
            nonfinite != "raise",
            f"train.nonfinite = {nonfinite!r} (the optimizer steps inside its own iterations; "
            "'raise' notices a NaN from the losses it returns)",
        ),
        (
            processes > 1,
            "several processes (each would decide its iterations on its own loss and wait for "
            "the others in a different place)",
        ),
    ]
    for refuse, what in refused:
        if refuse:
            raise ConfigError(
                f"config: an optimizer whose step takes a closure (LBFGS) does not support {what}"
            )
    return True


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter ``optimizer`` updates, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class Optimizers(dict[str, torch.optim.Optimizer]):
    """Several optimizers by name (a GAN's generator and discriminator, or one per parameter
    group): one object the loop steps, zeroes and checkpoints like an optimizer.

    ``step()`` steps each in turn (the default ``train_step``: one loss, several optimizers);
    a ``train_step`` that steps them separately uses ``self.optimizer["g"]``.
    ``param_groups`` is every optimizer's groups in order (the first is the logged ``lr``).
    """

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.values() for group in optimizer.param_groups]

    @property
    def defaults(self) -> dict[str, Any]:
        return {name: optimizer.defaults for name, optimizer in self.items()}

    def step(self) -> None:
        for optimizer in self.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: optimizer.state_dict() for name, optimizer in self.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, optimizer in self.items():
            optimizer.load_state_dict(state[name])


class Schedulers(dict[str, Any]):
    """Several learning-rate schedulers by name (one per optimizer of :class:`Optimizers`),
    stepped together; ``ReduceLROnPlateau`` ones get the monitored value."""

    def step(self, metric: float | None = None) -> None:
        for scheduler in self.values():
            plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
            scheduler.step(metric) if plateau else scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: scheduler.state_dict() for name, scheduler in self.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, scheduler in self.items():
            scheduler.load_state_dict(state[name])


def one_optimizer(
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """``optimizer``, or several by name (a GAN's generator and discriminator) as one
    :class:`Optimizers`, which the loop steps, zeroes and checkpoints like an optimizer;
    anything else (an empty dict, a class instead of an instance) refused in one line."""
    if isinstance(optimizer, Mapping):
        if not optimizer:
            raise ConfigError(
                "optimizer: an empty dict of optimizers has nothing to step; pass one "
                "torch.optim optimizer, or several by name ({'g': ..., 'd': ...})"
            )
        for name, each in optimizer.items():
            _check_optimizer(each, f"optimizer[{name!r}]")
        return cast(torch.optim.Optimizer, Optimizers(optimizer))
    _check_optimizer(optimizer, "optimizer")
    return optimizer


def _check_optimizer(optimizer: Any, what: str) -> None:
    """What the loop calls on an optimizer (accelerate's rule: refused when it is handed over,
    not at the first step or checkpoint)."""
    needed = ("step", "zero_grad", "state_dict", "load_state_dict", "param_groups")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing or isinstance(optimizer, type):
        kind = f"the class {optimizer.__name__}" if isinstance(optimizer, type) else "it"
        raise ConfigError(
            f"{what}: {kind} is not an optimizer instance (it needs {', '.join(needed)}); pass "
            "e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)"
        )


def check_kernels(optimizer: torch.optim.Optimizer) -> None:
    """``capturable=True`` (a kernel for CUDA graphs) on parameters of a device torch has no
    such kernel for (a CPU) is refused in one line; torch would assert at the first step."""
    supported = _capturable_devices()
    for group in optimizer.param_groups:
        devices = sorted({p.device.type for p in group["params"]} - set(supported))
        if group.get("capturable") and devices:
            raise ConfigError(
                f"optim: capturable = true needs parameters on {', '.join(supported)}; they "
                f"are on {', '.join(devices)}. Drop optim.capturable (it only chooses a kernel)"
            )


def _capturable_devices() -> list[str]:
    """The device types torch's capturable optimizer kernels run on (torch's own list)."""
    from torch.optim import optimizer as base

    listed = getattr(base, "_get_capturable_supported_devices", None)
    try:
        return list(listed()) if listed is not None else ["cuda"]
    except Exception:  # a private helper of torch's: its list when it works, else CUDA's
        return ["cuda"]
