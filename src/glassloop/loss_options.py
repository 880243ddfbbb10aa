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
# The loss a task trains with when loss.name is not given (a regression's is not a
# cross-entropy over its one column: loss 0.0 at every step).
TASK_LOSSES = {
    "classification": "cross_entropy",
    "language-model": "cross_entropy",
    "multilabel": "bce_with_logits",
    "regression": "mse",
}
POSITIVE = Range(0.0, open_low=True)


def loss_fits(implied: str, task: str) -> bool:
    """Whether a loss that implies the task ``implied`` can train ``task`` (a language
    model's loss is a classification's, per token; ``custom`` takes any loss).

    >>> loss_fits("classification", "language-model"), loss_fits("classification", "regression")
    (True, False)
    """
    same_kind = implied == "classification" and task == "language-model"
    return implied == task or same_kind or task == "custom"


@dataclass
class LossConfig:
    """The loss by name (``"mean"`` reduction); its options apply where the loss has them.
    ``train.ignore_index`` is the label cross_entropy and nll leave out."""

    # (not given: the task's, TASK_LOSSES; a config's train.task and loss.name must fit)
    name: str = option("cross_entropy", rule=tuple(LOSS_TASKS))
    label_smoothing: float = option(0.0, rule=FRACTION)  # cross_entropy
    # bce_with_logits: one per label
    pos_weight: list[float] = option([], rule=POSITIVE)
    delta: float = option(1.0, rule=POSITIVE)  # huber
    beta: float = option(1.0, rule=POSITIVE)  # smooth_l1
