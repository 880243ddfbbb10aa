"""Validation during ``fit``: which sets, how much of each, and the ``val_*`` numbers of a row.

``fit(train, val)`` validates on one loader or on several by name (``{"in": a, "ood": b}``):
each set's numbers as ``val_<name>_*``, the first set's also as ``val_*`` (what a monitor,
the plateau scheduler and the report read unless told otherwise). The loop calls it in one
line, as torchtitan's trainer calls its validator; what is evaluated is the trainer's own
``evaluate`` (an override included), between the callbacks' validation hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol

import torch
from torch import nn

import glassloop.distributed.preemption as preemption
from glassloop.best import is_number
from glassloop.callbacks import Callback
from glassloop.data.loaders import LoaderPosition
from glassloop.distributed.preemption import StopRequested
from glassloop.distributed.world import World, agreed_stop
from glassloop.evaluation.evaluate import first_batches, gathered_outputs
from glassloop.rng import capture_rng_state, restore_rng_state
from glassloop.state import TrainState
from glassloop.storage.file_names import check_name

# What fit validates on: one loader, or several by name ({"in": a, "ood": b}).
Validation = Iterable[Any] | Mapping[str, Iterable[Any]]


class Validating(Protocol):
    """What the validator needs of a trainer (not the loop's class: no import of it)."""

    @property
    def callbacks(self) -> Sequence[Callback]: ...

    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]: ...

    # (for a regression's outputs: :meth:`Validator.outputs`)
    @property
    def eval_model(self) -> nn.Module: ...

    device: torch.device
    precision: str
    world: World


class Validator:
    """The validation sets of one ``fit``; ``limit``: at most this many batches of each
    (``limit_batches``; ``counted``: an FSDP run evens the processes' batch counts out);
    ``every``: also inside epochs, every this many steps (``validate_every_n_steps``), each
    such row handed to ``sinks``."""

    def __init__(
        self,
        sets: Validation | None,
        *,
        limit: int = 0,
        counted: bool = False,
        every: int = 0,
        sinks: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        if sets is None:
            self.sets: dict[str, Iterable[Any]] = {}
        else:
            self.sets = dict(sets) if isinstance(sets, Mapping) else {"": sets}
        if isinstance(sets, Mapping):  # (each names its val_<name>_* keys and their plots)
            for name in self.sets:
                if name != "":  # (a set without a name: its numbers as val_* only)
                    check_name(name, "fit: validation set")
        self.limit, self.counted, self.sinks = limit, counted, sinks
        self.every = every if self.sets else 0  # (read every step: an attribute, no call)
        self.last: dict[str, Any] | None = None  # the first set's metrics (the report's)
        self.last_row: dict[str, Any] | None = None  # the last mid-epoch row handed out

    @property
    def first(self) -> Iterable[Any] | None:
        """The set a report plots (the first)."""
        return next(iter(self.sets.values()), None)

    def row(self, trainer: Validating) -> dict[str, Any]:
        """Evaluate every set; its numbers as they go into a history row. Abandoned on a stop
        signal (:class:`~glassloop.distributed.preemption.StopRequested`, see :class:`Abandonable`)
        with what it changed put back (the RNG, the callbacks' states, the last metrics): the
        resumed run validates again, drawing what this validation drew (a ``DataLoader`` draws its
        workers' seed even unshuffled), so its numbers and everything after are the uninterrupted
        run's. (A set abandoned gets no ``on_validation_end``.)"""
        row: dict[str, Any] = {}
        rng, last = capture_rng_state(), self.last
        states = [c.state_dict() if hasattr(c, "state_dict") else None for c in trainer.callbacks]
        try:
            for i, (name, loader) in enumerate(self.sets.items()):
                metrics = self.validate(trainer, loader)
                numbers = {k: v for k, v in metrics.items() if is_number(v)}
                if i == 0:
                    self.last = metrics
                    row.update({f"val_{k}": v for k, v in numbers.items()})
                if name:
                    row.update({f"val_{name}_{k}": v for k, v in numbers.items()})
        except StopRequested:
            restore_rng_state(rng)
            self.last = last
            for callback, state in zip(trainer.callbacks, states, strict=True):
                if state is not None and hasattr(callback, "load_state_dict"):
                    callback.load_state_dict(state)
            raise
        return row

    def mid_epoch(self, trainer: Validating, state: TrainState) -> None:
        """Validation inside an epoch (``every``): a ``"kind": "val"`` row of every set, handed
        to each of the ``sinks`` (the run log's rows, the console). ``state.validation_due``
        is "step" until the row is out: a checkpoint of a validation a stop signal cut short
        says so, and the resumed run validates first (:meth:`Trainer._run_epoch`)."""
        state.validation_due = "step"
        row: dict[str, Any] = {"kind": "val", "epoch": state.epoch + 1, "step": state.step}
        row.update(self.row(trainer))
        state.validation_due = ""
        self.last_row = row
        for sink in self.sinks:
            sink(row)

    def validate(self, trainer: Validating, loader: Iterable[Any]) -> dict[str, Any]:
        """``trainer.evaluate`` on (the first ``limit`` batches of) ``loader``, between the
        callbacks' ``on_validation_start`` and ``on_validation_end``."""
        for callback in trainer.callbacks:
            callback.on_validation_start(trainer)
        limit = self.limit
        shown = first_batches(loader, limit, counted=self.counted) if limit else loader
        if not (self.counted and trainer.world.distributed):  # (FSDP: in its evened forwards)
            shown = abandonable(shown, trainer.world)
        # A glassloop loader: epoch 0's batches in every validation, whatever ran before (an
        # earlier fit, an evaluate, a peek; a resume in a new process starts there too).
        position = loader if isinstance(loader, LoaderPosition) else None
        where = position.state_dict() if position is not None else {}
        if position is not None:
            position.load_state_dict({"epoch": 0, "batches_consumed": 0})
        try:
            with preemption.validating():
                metrics = trainer.evaluate(shown)
        finally:  # (also when abandoned) left where it was: the training loader's own too
            if position is not None:
                position.load_state_dict(where)
        for callback in trainer.callbacks:
            callback.on_validation_end(trainer, metrics)
        return metrics

    def outputs(self, trainer: Validating) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A regression's outputs and targets on the first set (every process: its shard),
        for the report's predicted-vs-true plot; ``None`` without a validation set."""
        first = self.first
        if first is None:
            return None
        model, device, world = trainer.eval_model, trainer.device, trainer.world
        return gathered_outputs(model, first, device, trainer.precision, world)


class Abandonable:
    """``loader`` as a validation in ``fit`` iterates it: before each batch is fetched the
    stop flag is read, and a stop signal abandons the validation (:class:`StopRequested`) within one
    batch instead of after the whole set (a scheduler's grace is often shorter than a long
    validation). One process reads its own flag; several agree in one small collective per batch
    (:func:`glassloop.distributed.world.agreed_stop`), a process that has run out of batches taking
    part until every one has, so all leave at the same batch and none waits in the metrics'
    reduction for the others. (FSDP's evened forwards agree instead:
    :func:`glassloop.distributed.fsdp.agree_on_a_stop`.) Outside a fit's validation it only
    iterates."""

    def __init__(self, loader: Iterable[Any], world: World) -> None:
        self.loader, self.world = loader, world

    def __iter__(self) -> Iterator[Any]:
        end = object()
        iterator = iter(self.loader)
        while not self.world.distributed:  # one process: the flag, then the next batch
            if signum := preemption.requested() if preemption.abandoning() else 0:
                raise StopRequested(signum)
            batch = next(iterator, end)
            if batch is end:
                return
            yield batch
        while True:  # several: each fetches, then all agree (the batch dropped on a stop)
            batch = next(iterator, end)
            signum = preemption.requested() if preemption.abandoning() else 0
            signum, more = agreed_stop(signum, batch is not end)
            if signum:
                raise StopRequested(signum)
            if not more:
                return
            if batch is not end:
                yield batch


class SizedAbandonable(Abandonable):
    """An :class:`Abandonable` of a loader with a ``len()`` (the bar reads it)."""

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def abandonable(loader: Iterable[Any], world: World) -> Abandonable:
    """``loader`` as a validation in ``fit`` iterates it (:class:`Abandonable`)."""
    kind = SizedAbandonable if isinstance(loader, Sized) else Abandonable
    return kind(loader, world)
