"""A micro-batch that fits, with the same mathematics: each batch the loader gives is split into
micro-batches of at most ``micro_batch_size`` rows, whose losses are weighted by their share
of the step's samples (or tokens), so the step's gradient is the whole batch's; the global
batch, the learning rate and the schedule stay as they were.

``micro_batch_size="auto"``: in a run's first :data:`TRIAL_STEPS` steps, an out-of-memory error
(CUDA's, MPS's, or any ``torch.OutOfMemoryError`` a model raises) halves the micro-batch,
doubling how many make a batch, and retries the step from the same state (gradients, RNG and
buffers as before it). The plan it settles on is printed and kept in every checkpoint: a
resumed run starts from it. Under DDP every process tries each of those steps first without
reducing gradients and they agree on the result (an error in one process alone would leave
the others waiting in the reduction); FSDP gathers weights inside its forward, so one
process's error would hang the others there: a number of rows is required with it.

Only the batch's rows are split: a layer that computes statistics over the batch (batch norm)
sees the smaller micro-batches, as it does under gradient accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from glassloop.batch import Inputs, batch_size_of
from glassloop.distributed.fsdp import gradient_sync
from glassloop.distributed.world import all_reduce
from glassloop.errors import ConfigError
from glassloop.rng import capture_rng_state, restore_rng_state
from glassloop.step.window import Window, split_rows

TRIAL_STEPS = 8  # the first steps of a run (or of a resume) in which "auto" may still halve
Micro = tuple[Inputs, Any]


class MicroBatches:
    """How a step's batches are split (``rows``: at most this many rows each; ``None``: as
    the loader gives them) and, for ``"auto"``, the trial of its first steps."""

    def __init__(
        self, size: int | str | None, *, sharded: bool = False, closure: bool = False
    ) -> None:
        if size == "auto" and sharded:
            raise ConfigError(
                "train.micro_batch_size = 'auto' under FSDP: an out-of-memory error in one "
                "process would leave the others waiting inside the sharded forward; give a "
                "number of rows (e.g. micro_batch_size = 8)"
            )
        if size == "auto" and closure:
            raise ConfigError(
                "train.micro_batch_size = 'auto' with an optimizer that takes a closure "
                "(LBFGS): its step runs forward and backward itself, so an out-of-memory "
                "error cannot be undone and retried; give a number of rows"
            )
        if not (size in (None, "auto") or (isinstance(size, int) and size >= 0)):
            raise ConfigError(
                f"train.micro_batch_size must be a number of rows (0: off) or 'auto', got {size!r}"
            )
        self.auto = size == "auto"
        self.rows: int | None = None if size in (None, 0, "auto") else int(size)
        self.trials_left = TRIAL_STEPS if self.auto else 0  # (steps an out-of-memory halves)
        self.halved_from: int | None = None  # the batch rows that did not fit, to be said

    def halve(self, micro: list[Micro]) -> None:
        """After an out-of-memory error: half as many rows per micro-batch (an error when a
        single row did not fit)."""
        largest = max(batch_size_of(target, inputs) for inputs, target in micro)
        rows = min(self.rows or largest, largest)
        if rows <= 1:
            raise ConfigError(
                "train.micro_batch_size = 'auto': out of memory with micro-batches of 1 row; "
                "the model does not fit on this device at this precision (try bf16, "
                "activation_checkpointing, or FSDP over more processes)"
            )
        if self.halved_from is None:
            self.halved_from = largest
        self.rows = (rows + 1) // 2

    def settled(self, micro: list[Micro]) -> str | None:
        """After a step that fit: the line saying the plan, once, when it changed."""
        self.trials_left -= 1
        if self.halved_from is None or self.rows is None:
            return None
        rows, self.halved_from = self.halved_from, None
        parts = len(split_rows(micro[0], self.rows))
        return (
            f"micro-batches: {rows} rows did not fit in memory; each batch of {rows} is now "
            f"{parts} micro-batches of at most {self.rows} rows (the global batch and its "
            "weighting are unchanged; checkpoints keep the plan for a resume)"
        )

    def attempt(self, trainer: Stepping, window: Window) -> Tried:
        """One try of the step on ``window``; an out-of-memory error in it (in any process)
        leaves everything as before the try (:class:`Attempt`) and ``fits=False``. Several
        processes first try it without reducing gradients (a process that failed alone
        would leave the others waiting in the reduction), agree, and then take the step."""
        model = trainer.model
        attempt, fits, loss = Attempt(model, trainer.optimizer, trainer.scaler), True, None
        try:
            if trainer.distributed:  # a trial: no collective to leave another process in
                with gradient_sync(model, False), _no_buffer_broadcast(model):
                    trainer.forward_backward(window)
            else:
                loss = trainer.train_step(window)
        except torch.OutOfMemoryError:
            if attempt.stepped:  # in optimizer.step(): some weights may have moved
                raise
            fits = False
        finally:
            attempt.close()
        if trainer.distributed:  # every process's verdict; the trial itself is undone
            fits = not all_reduce(torch.tensor([float(not fits)]), "max")
            attempt.undo()
            loss = trainer.train_step(window) if fits else None
        elif not fits:
            attempt.undo()
        return Tried(fits, loss)

    def first_step(
        self, trainer: Stepping, micro: list[Micro], window: Window, signum: int | None
    ) -> tuple[Any, Window, int | None]:
        """A first step of ``"auto"``: retried from the same state with half as many rows
        after an out-of-memory error (:meth:`attempt`), until it fits; its loss, and the
        window and stop signal of the try that fit."""
        while not (tried := self.attempt(trainer, window)).fits:  # (undone: RNG, buffers, grads)
            self.halve(micro)
            trainer._correct = None  # (what the failed try counted)
            window, signum = trainer.windows.make(micro, trainer._signals.received, self.rows)
        if (line := self.settled(micro)) is not None:
            trainer.console.message(line)
        return tried.loss, window, signum

    def note(self, task: str, loss_weighting: str) -> str | None:
        """A line for the header when split batches would not add up to the whole one: a
        language model's loss is a mean over tokens, and ``loss_weighting="samples"``
        weights each micro-batch's mean by its rows."""
        if (self.auto or self.rows) and task == "language-model" and loss_weighting != "tokens":
            return (
                "warning: micro_batch_size splits a language model's batches, and with "
                "loss_weighting = 'samples' each part's token mean counts by its rows, not "
                "its tokens: set loss_weighting = 'tokens' for the whole batch's loss"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state["rows"]
        if rows is not None and (not isinstance(rows, int) or rows < 1):
            raise ValueError(f"micro_batches.rows = {rows!r}")
        self.rows = rows


class Stepping(Protocol):
    """What :meth:`MicroBatches.attempt` and :meth:`MicroBatches.first_step` need of a
    trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    distributed: bool
    scaler: torch.amp.GradScaler
    windows: Any  # (glassloop.step.window.Windows)
    console: Any  # (its message(): a line for the user)
    _signals: Any  # (its received: the stop signal this process got)
    _correct: torch.Tensor | None  # (train_accuracy's count of the try)

    def train_step(self, window: Window) -> Any: ...
    def forward_backward(self, window: Window, zero_grad: bool = False) -> torch.Tensor: ...


@dataclass
class Tried:
    """How a try of a step went: whether it fit, and its loss (``train_step``'s)."""

    fits: bool
    loss: Any


class Attempt:
    """What a retried step must find as it was: the RNG states and the model's buffers (batch
    norm's statistics), taken before a trial step; and whether the optimizer began to step
    (an out-of-memory error there is not retried: some weights may have moved)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.rng = capture_rng_state()
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.scale = scaler.state_dict() if scaler.is_enabled() else None
        self.stepped = False
        # each torch optimizer's (several by name: glassloop.config.optimizers.Optimizers)
        each = optimizer.values() if isinstance(optimizer, dict) else [optimizer]
        self._hooks = [
            o.register_step_pre_hook(self._stepping)
            for o in each
            if hasattr(o, "register_step_pre_hook")
        ]

    def _stepping(self, *_: Any) -> None:
        self.stepped = True

    def undo(self) -> None:
        """Back to before the attempt: no gradients, the RNG, buffers and fp16 scaler as
        they were."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        restore_rng_state(self.rng)
        if self.scale is not None:
            self.scaler.load_state_dict(self.scale)
            # (an unscale_() the attempt made is recorded per optimizer until update(), which
            # would also move the scale: the record is dropped, as update() drops it)
            self.scaler._per_optimizer_states.clear()
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed attempt's blocks, back for the next

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


@contextlib.contextmanager
def _no_buffer_broadcast(model: nn.Module) -> Iterator[None]:
    """DDP broadcasts buffers (batch norm's) at each forward: a collective, which a process
    that ran out of memory in an earlier forward would never join. Off for a trial (the
    buffers are put back after it; the step itself broadcasts as usual)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        yield
        return
    before = model.require_forward_param_sync  # (what DDP reads before a forward's broadcast)
    model.require_forward_param_sync = False
    try:
        yield
    finally:
        model.require_forward_param_sync = before
