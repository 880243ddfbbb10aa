"""TrainState: where the loop is (step, epoch, batch within the epoch, samples seen, best)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    """The loop's position, saved in every checkpoint so a resume knows where it stands.

    ``step`` counts optimizer steps; ``epoch`` counts finished epochs; ``batch_in_epoch``
    counts batches consumed in the current epoch; ``samples_seen`` counts training samples.

    >>> s = TrainState(step=3)
    >>> TrainState().load_state_dict(s.state_dict()) or None
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    best_metric: float | None = None
    skipped_steps: int = 0  # fp16 overflows and non-finite steps skipped
    consecutive_nonfinite: int = 0
    stopped: bool = False  # stopped early (a callback): the run is finished, whatever epochs says

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
        self.stopped = bool(state.get("stopped", False))
        best = state.get("best_metric")
        self.best_metric = None if best is None else float(best)
