"""Observer hooks. A callback watches the loop and may ask it to stop; it never runs it.

Hooks are called at fit start, after every epoch (with the epoch's row of metrics) and at fit
end. To stop training, set ``trainer.should_stop = True``; the loop finishes the epoch's
bookkeeping and returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from glassloop.loop import Trainer


class Callback:
    """Base class: override the hooks you need; each default does nothing.

    >>> class StopAfter(Callback):
    ...     def __init__(self, n): self.n = n
    ...     def on_epoch_end(self, trainer, row):
    ...         if row["epoch"] >= self.n: trainer.should_stop = True
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Called once before the first epoch."""

    def on_epoch_end(self, trainer: Trainer, row: dict[str, Any]) -> None:
        """Called after each epoch's training and validation, with the epoch's metrics."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """Called once after the last epoch, also when a callback stopped the run early."""
