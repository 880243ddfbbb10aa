"""The ``[loss]`` section of a config: the loss by name and its options. Owned here,
torch-free, next to :mod:`glassloop.losses` that builds it (so that reading a config imports
no torch); :mod:`glassloop.config` composes it."""

from __future__ import annotations

from dataclasses import dataclass

from glassloop.options import option
from glassloop.rules import FRACTION, Range

# The losses by name, and the task each implies when train.task is "auto".
LOSS_TASKS = {
    "cross_entropy": "classification",
    "nll": "classification",
    "bce_with_logits": "multilabel",
    "mse": "regression",
    "l1": "regression",
    "huber": "regression",
    "smooth_l1": "regression",
}
POSITIVE = Range(0.0, open_low=True)


@dataclass
class LossConfig:
    """The loss by name (``"mean"`` reduction); its options apply where the loss has them.
    ``train.ignore_index`` is the label cross_entropy and nll leave out."""

    name: str = option("cross_entropy", rule=tuple(LOSS_TASKS))
    label_smoothing: float = option(0.0, rule=FRACTION)  # cross_entropy
    # bce_with_logits: one per label
    pos_weight: list[float] = option([], rule=POSITIVE)
    delta: float = option(1.0, rule=POSITIVE)  # huber
    beta: float = option(1.0, rule=POSITIVE)  # smooth_l1
