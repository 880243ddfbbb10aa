"""Weights no gradient reaches, named while a fresh run trains.

``glassloop doctor`` checks one batch before training; this is the same check inside
``fit``, for a Trainer built in Python too.

At each of a fresh run's first :data:`STEPS` optimizer steps, just before the step, the
parameters each optimizer trains are looked at: those whose gradient is missing (``None``:
the forward never used them) or all zero (cut off: a ``detach``, a ReLU dead for every
sample, a layer multiplied by zero). One step is not enough to call a weight dead: a LoRA
adapter's ``lora_A`` gets a zero gradient at the first step (its ``lora_B`` starts at zero),
as does every layer before a zero-initialised residual branch; they get gradients from the
second step on. What still has none after :data:`STEPS` steps is said in one warning line;
the run goes on (a weight left out on purpose is the user's call: freeze it and the line goes).

It costs one host read of a maximum per trainable tensor at the first step, then one per
tensor still suspected, for at most :data:`STEPS` steps; nothing after them, nothing on a
resumed run. Not under FSDP (a parameter is a shard there: a rank may hold none of it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from glassloop.distributed.world import unwrap_model

STEPS = 10  # steps a weight may go without a gradient before it is named
NAMED = 5  # names in the line (then "and N more")


class GradientFlow:
    """The check (see the module docstring): :meth:`check` before each of the first steps
    while :attr:`pending`."""

    def __init__(self, model: nn.Module, say: Callable[[str], None], loss: object = None) -> None:
        """``model``: its parameters named as its own module's (under DDP or compiled);
        ``loss``: the loss function, named ``loss.<name>`` when it has parameters."""
        own = unwrap_model(model)
        self.names = {id(p): name for name, p in own.named_parameters()}
        if isinstance(loss, nn.Module):  # (a loss with learnable weights)
            self.names.update({id(p): f"loss.{name}" for name, p in loss.named_parameters()})
        self.say = say
        self.pending = False  # set by fit: a fresh run, not sharded
        self._suspects: dict[int, list[torch.nn.Parameter]] = {}  # per optimizer
        self._steps: dict[int, int] = {}

    def start(self, fresh: bool, sharded: bool) -> None:
        """Check the coming steps when the run is ``fresh`` (a resumed one was checked)."""
        self.pending = fresh and not sharded
        self._suspects, self._steps = {}, {}

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer``'s step: its trainable parameters without a gradient so far;
        named at its :data:`STEPS`-th step. Pending until every optimizer seen got there."""
        key = id(optimizer)
        steps = self._steps[key] = self._steps.get(key, 0) + 1
        if steps <= STEPS:
            if steps == 1:  # its first step: every parameter it trains
                trained = {id(p): p for group in optimizer.param_groups for p in group["params"]}
                self._suspects[key] = [p for p in trained.values() if p.requires_grad]  # (once)
            suspects = self._suspects[key]
            if suspects:  # (one host read)
                suspects = [p for p, dead in zip(suspects, _dead(suspects), strict=True) if dead]
            self._suspects[key] = suspects
            if steps == STEPS and suspects:
                self.say(self.line(suspects))
        self.pending = min(self._steps.values()) < STEPS

    def line(self, dead: list[torch.nn.Parameter]) -> str:
        missing = [self.names.get(id(p), "?") for p in dead if p.grad is None]
        zero = [self.names.get(id(p), "?") for p in dead if p.grad is not None]
        parts = []
        if missing:
            parts.append(f"no gradient (unused by the forward) for {_listed(missing)}")
        if zero:
            parts.append(f"an all-zero gradient for {_listed(zero)}")
        return (
            f"warning: gradients: in the first {STEPS} steps, {'; '.join(parts)}: they have "
            "not learned yet; if they should, find what cuts them off (detach, a dead ReLU, a "
            "layer left out of forward, a learning rate of 0), else freeze them "
            "(requires_grad=False)"
        )


def _dead(parameters: list[torch.nn.Parameter]) -> list[bool]:
    """Whether each parameter's gradient is missing or all zero (one host read; NaN is not
    zero: the non-finite check names it)."""
    present = [p.grad for p in parameters if p.grad is not None]
    if not present:
        return [True] * len(parameters)
    device = present[0].device
    one = torch.ones((), device=device)  # (an empty tensor has no maximum: never dead)
    peaks = [
        g.abs().amax().float().to(device) if g.numel() and g.layout == torch.strided else one
        for g in present  # (a sparse gradient, nn.Embedding(sparse=True)'s: rows it reached)
    ]
    found = iter(torch.stack(peaks).tolist())
    return [p.grad is None or next(found) == 0 for p in parameters]


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
