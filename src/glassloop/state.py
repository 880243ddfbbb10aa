"""The loop's own state: :class:`TrainState` (where the loop is: step, epoch, batch within the
epoch, samples seen, best) and :class:`EpochRecord` (what it has recorded so far)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from glassloop.distributed import World, all_reduce


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


class EpochRecord:
    """What the loop records as it goes, beyond its position: the current epoch's per-step
    losses (kept on the device: no host sync per step) and sample counts, the RNG state a
    plain loader drew this epoch's order from (so a resume can replay it), and the history
    of finished epochs. Its ``state_dict()`` is part of every checkpoint, so a resumed
    epoch's ``train_loss`` is exact."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.epoch_rng: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []

    def add_step(self, loss: torch.Tensor, samples: int) -> None:
        self.losses.append(loss)
        self.sizes.append(samples)

    def end_epoch(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.losses, self.sizes = [], []

    def mean_loss(self) -> float | None:
        """This process's mean training loss of the epoch so far (a host sync), for the
        progress bar; ``None`` before the first step."""
        if not self.losses:
            return None
        weights = torch.tensor(self.sizes, dtype=torch.float64, device=self.losses[0].device)
        return float(torch.stack(self.losses).to(torch.float64) @ weights / weights.sum())

    def train_loss(self, world: World, device: torch.device) -> tuple[float, int]:
        """The epoch's mean training loss over every process's samples, and their number
        (NaN when every step of the epoch was skipped)."""
        if not self.losses:
            return float("nan"), sum(self.sizes)
        weights = torch.tensor(self.sizes, dtype=torch.float64, device=device)
        loss_sum = torch.stack(self.losses).to(torch.float64) @ weights
        if world.distributed:  # the mean over every process's samples
            sums = all_reduce(torch.stack([loss_sum, weights.sum()]).cpu())
            loss_sum, weights = sums[0], sums[1:]
        samples = int(weights.sum())
        return float(loss_sum) / samples, samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch_losses": torch.stack(self.losses) if self.losses else None,
            "epoch_sizes": list(self.sizes),
            "epoch_rng": self.epoch_rng,
            "history": self.history,
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        losses = state["epoch_losses"]
        self.losses = list(losses.to(device).unbind()) if losses is not None else []
        self.sizes = [int(n) for n in state["epoch_sizes"]]
        self.epoch_rng = state.get("epoch_rng")
        self.history = list(state["history"])
