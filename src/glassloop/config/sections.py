"""The sections of a config that name a torch part: ``[model]`` (a built-in model and its
sizes, or your own class), ``[loss]`` (the loss by name), ``[optim]`` and ``[scheduler]`` (a
``torch.optim`` class and a ``torch.optim.lr_scheduler`` class by name, and their keyword
arguments). Owned here, torch-free, next to the modules that build them
(:mod:`glassloop.config.schema.models`, :mod:`~glassloop.config.schema.losses`,
:mod:`~glassloop.config.schema.optimizers`), so that reading a config imports no torch;
:mod:`glassloop.config.schema.schema` composes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glassloop.options import SCHEDULER_INTERVALS, option
from glassloop.rules import FRACTION, Range

# ------------------------------------------------------------------------------- [model]
# The built-in models, and the [model] keys each reads (model.kwargs is for a model.target
# class).
BUILT_IN_KEYS = {
    "mlp": ("hidden", "dropout"),
    "cnn": ("dropout",),
    "text-classifier": ("embed_dim", "encoder", "num_layers", "num_heads", "dropout"),
}


@dataclass
class ModelConfig:
    """``name="mlp"`` (``hidden``, ``dropout``), ``name="text-classifier"`` (``embed_dim``,
    ``encoder``, ``num_layers``, ``num_heads``, ``dropout``), or ``target="pkg.module:Class"``
    / ``"path/to/file.py:Class"`` with ``kwargs`` for your own model."""

    name: str = option("mlp", rule=tuple(BUILT_IN_KEYS))
    """a built-in model: "mlp" (Flatten, then Linear/ReLU[/Dropout] per hidden width, then
    Linear), "cnn" or "text-classifier"."""
    hidden: list[int] = option([512, 512], rule=Range(1, 2**20))
    """mlp: the hidden layers' widths."""
    dropout: float = option(0.0, rule=FRACTION)
    """mlp, text-classifier: dropout after each hidden layer (0: none)."""
    target: str = ""
    """your own model: "package.module:Class" or "path/to/file.py:Class" (imported: a config
    you pass is trusted like a script)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments for ``target``, e.g. ``{ width = 64 }``."""
    # text-classifier: embedding + encoder ("gru" or "transformer") + masked mean pooling
    embed_dim: int = option(64, rule=Range(1, 2**16))
    """text-classifier: the embedding's width."""
    encoder: str = option("gru", rule=("gru", "transformer"))
    """text-classifier: "gru" or "transformer"."""
    num_layers: int = option(1, rule=Range(1, 1024))
    """text-classifier: encoder layers."""
    num_heads: int = option(4, rule=Range(1, 1024))
    """text-classifier, transformer: attention heads."""


# -------------------------------------------------------------------------------- [loss]
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


@dataclass
class LossConfig:
    """The loss by name (``"mean"`` reduction); its options apply where the loss has them.
    ``train.ignore_index`` is the label cross_entropy and nll leave out."""

    # (not given: the task's, TASK_LOSSES; a config's train.task and loss.name must fit)
    name: str = option("cross_entropy", rule=tuple(LOSS_TASKS))
    """"cross_entropy", "nll", "bce_with_logits", "mse", "l1", "huber" or "smooth_l1" (not
    given: the task's own, e.g. mse for a regression)."""
    label_smoothing: float = option(0.0, rule=FRACTION)
    """cross_entropy: label smoothing."""
    pos_weight: list[float] = option([], rule=POSITIVE)
    """bce_with_logits: one weight per label (its positives count more)."""
    delta: float = option(1.0, rule=POSITIVE)
    """huber: where the loss turns from quadratic to linear."""
    beta: float = option(1.0, rule=POSITIVE)
    """smooth_l1: where the loss turns from quadratic to linear."""


# ---------------------------------------------------------------------- [optim], [scheduler]
@dataclass
class OptimConfig:
    """Any ``torch.optim`` class by name; other keys are its keyword arguments."""

    name: str = "AdamW"
    """any ``torch.optim`` class by name."""
    lr: float = option(1e-3, rule=Range(0, open_low=True))  # lr = 0 trains nothing, silently
    """the learning rate."""
    no_decay_bias_norm: bool = False
    """true: biases and norm weights (1-D parameters) get no weight decay."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """(every other key: a keyword argument of that class, checked by name and type, e.g.
    ``weight_decay = 0.01``)"""


@dataclass
class SchedulerConfig:
    """Any ``torch.optim.lr_scheduler`` class by name (``"none"`` for none); other keys are
    its keyword arguments. ``CosineAnnealingLR`` without ``T_max`` spans the whole run.
    ``"warmup_cosine"`` (built in, per optimizer step): linear warmup over ``warmup_steps``,
    then cosine down to ``min_lr_ratio`` x lr at the end of the run."""

    name: str = "CosineAnnealingLR"
    """any ``torch.optim.lr_scheduler`` class by name, "warmup_cosine" (``warmup_steps``,
    ``min_lr_ratio``; per step) or "none"."""
    interval: str = option("epoch", rule=SCHEDULER_INTERVALS)
    """it steps every "epoch" or every optimizer "step"."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """(every other key: a keyword argument of that class; a cosine without ``T_max`` spans
    the run; ``ReduceLROnPlateau`` steps on val_loss)"""


# The default optimizer's keyword arguments as the resolved config records them (its own
# numeric defaults, read off AdamW's signature by glassloop.config.optimizers.optimizer_kwargs), so
# that reading a config that leaves [optim] alone needs no torch (importing it takes ~1.7 s).
# tests/config/test_config.py checks them against the installed torch's.
DEFAULT_OPTIM_KWARGS: dict[str, Any] = {
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
}
