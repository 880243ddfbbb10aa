"""Observer hooks. A callback watches the loop and may ask it to stop; it never runs it.

Hooks are called at fit start, after every optimizer step (with the step and its loss),
around every validation (with its metrics), after every epoch (with the epoch's row of
metrics, before it is written: keys a callback adds reach history, the console, metrics.csv,
metrics.jsonl, TensorBoard and ``checkpoint.monitor``), after every checkpoint and at fit
end. To stop training, set ``trainer.should_stop = True``; the loop finishes the epoch's
bookkeeping and returns. A callback with ``state_dict()``/``load_state_dict()`` is saved in
checkpoints and resumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from glassloop.best import improves, monitor_mode

if TYPE_CHECKING:
    from pathlib import Path

    import torch

# (Each hook's ``trainer`` is the glassloop.Trainer that runs the loop, typed Any here: the
# callbacks never import the loop, and a subclass may annotate it as Trainer.)
AnyTrainer = Any


class Callback:
    """Base class: override the hooks you need; each default does nothing.

    >>> class StopAfter(Callback):
    ...     def __init__(self, n): self.n = n
    ...     def on_epoch_end(self, trainer, row):
    ...         if row["epoch"] >= self.n: trainer.should_stop = True
    """

    def on_fit_start(self, trainer: AnyTrainer) -> None:
        """Called once before the first epoch."""

    def on_step_end(self, trainer: AnyTrainer, step: int, loss: torch.Tensor) -> None:
        """Called after each optimizer step (not after a skipped one) with the step number
        and the step's loss, detached and still on the device (``loss.item()`` waits for the
        device: do it only when you need the number)."""

    def on_validation_start(self, trainer: AnyTrainer) -> None:
        """Called before each validation pass (end of epoch, or every
        ``validate_every_n_steps`` steps)."""

    def on_validation_end(self, trainer: AnyTrainer, metrics: dict[str, Any]) -> None:
        """Called after each validation pass with its metrics (``loss``, ``accuracy``, ...);
        keys added here reach the epoch row as ``val_<key>``."""

    def on_epoch_end(self, trainer: AnyTrainer, row: dict[str, Any]) -> None:
        """Called after each epoch's training and validation, with the epoch's metrics;
        keys added to ``row`` are written with it."""

    def on_checkpoint(self, trainer: AnyTrainer, path: Path) -> None:
        """Called in every process after each checkpoint's save (``path``: its folder; not
        after ``best/``), once every process knows it succeeded. A background save
        (``async_save``) may still be writing it: ``trainer.checkpointer.wait()`` first to
        read it (what :class:`glassloop.distributed.ray_train.RayReport` does to hand it to
        Ray Train)."""

    def on_fit_end(self, trainer: AnyTrainer) -> None:
        """Called once after the last epoch, also when a callback stopped the run early."""


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    epochs. ``mode="auto"`` maximises metrics named like accuracy/F1 and minimises the rest.
    Its state is saved in checkpoints, so a resumed run counts patience where it left off.

    >>> stop = EarlyStopping("val_loss", patience=2)
    >>> stop.state_dict()
    {'best': None, 'bad_epochs': 0, 'stopped_epoch': None, 'watched': ['val_loss', 'min']}
    """

    def __init__(
        self, monitor: str, *, patience: int = 3, min_delta: float = 0.0, mode: str = "auto"
    ) -> None:
        self.monitor = monitor
        self.patience = patience
        self.min_delta = min_delta
        self.mode = monitor_mode(monitor, mode)
        self.best: float | None = None
        self.bad_epochs = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, trainer: AnyTrainer, row: dict[str, Any]) -> None:
        if self.monitor not in row:
            from glassloop.errors import ConfigError

            raise ConfigError(
                f"config: early_stopping.monitor {self.monitor!r} is not a metric of this run "
                f"(available: {', '.join(sorted(k for k in row if k != 'kind'))})"
            )
        value = float(row[self.monitor])
        if improves(value, self.best, self.mode, self.min_delta):
            self.best = value
            self.bad_epochs = 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped_epoch = int(row["epoch"])
            trainer.should_stop = True
            trainer.console.message(
                f"early stopping: {self.monitor} has not improved for {self.patience} epochs "
                f"(best {self.best:.6g})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "bad_epochs": self.bad_epochs,
            "stopped_epoch": self.stopped_epoch,
            "watched": [self.monitor, self.mode],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("watched", [self.monitor, self.mode]) != [self.monitor, self.mode]:
            return  # (a resume that watches another metric: its count starts here)
        self.best = state["best"]
        self.bad_epochs = int(state["bad_epochs"])
        self.stopped_epoch = state["stopped_epoch"]
