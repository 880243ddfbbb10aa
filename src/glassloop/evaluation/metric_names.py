"""Metrics by name (``Trainer(metrics=["top5_accuracy", "auroc"])``, ``train.metrics`` in a
config): torchmetrics objects, built when the first validation batch shows the number of
classes or outputs. torchmetrics is the field's standard (streaming, correct under DDP: each
metric adds up every process's state in ``compute``); it is imported only when a named metric
is used. The task's default metrics (:mod:`glassloop.evaluation.metrics`) need no name.

=================  ====================================================================
task               names
=================  ====================================================================
classification,    ``top<k>_accuracy`` (e.g. ``top5_accuracy``), ``balanced_accuracy``,
language-model     ``f1_<avg>``, ``precision_<avg>``, ``recall_<avg>`` with ``<avg>`` one of
                   ``macro``, ``micro``, ``weighted``; ``auroc`` (macro, one-vs-rest)
multilabel         ``auroc``, ``precision_<avg>``, ``recall_<avg>``, ``f1_weighted``
regression         ``mape``, ``explained_variance``, ``pearson``
=================  ====================================================================
"""

from __future__ import annotations

import re
from typing import Any

from glassloop.errors import ConfigError

AVERAGES = ("macro", "micro", "weighted")
NAMES = {
    "classification": (
        "top<k>_accuracy",
        "balanced_accuracy",
        "auroc",
        *(f"{kind}_{avg}" for kind in ("f1", "precision", "recall") for avg in AVERAGES),
    ),
    "multilabel": (
        "auroc",
        "f1_weighted",
        *(f"{kind}_{avg}" for kind in ("precision", "recall") for avg in AVERAGES),
    ),
    "regression": ("mape", "explained_variance", "pearson"),
}
NAMES["language-model"] = NAMES["auto"] = NAMES["classification"]
# What each task reports without being asked (glassloop.evaluation.metrics): asked for by name
# anyway (``metrics=["accuracy"]``, a Keras user's first line), it is accepted and reported once.
REPORTED = {
    "classification": ("loss", "accuracy"),
    "multilabel": ("loss", "accuracy", "exact_match", "f1_micro", "f1_macro"),
    "regression": ("loss", "mae", "rmse", "r2"),
    "language-model": ("loss", "accuracy", "perplexity"),
}
REPORTED["auto"] = REPORTED["classification"]


def check_metric_name(name: str, task: str) -> None:
    """Refuse a name that ``task`` has no metric for, listing those it has."""
    known = (*REPORTED.get(task, ()), *NAMES.get(task, ()))
    if name in known or (name != "top<k>_accuracy" and _top_k(name) and "top<k>_accuracy" in known):
        return
    listed = ", ".join(known) if known else "none (give metric objects instead)"
    raise ConfigError(f"metrics: no metric {name!r} for a {task} task; known: {listed}")


def make_metric(name: str, task: str, num_outputs: int) -> Any:
    """The torchmetrics object for ``name`` with ``num_outputs`` classes, labels or outputs."""
    check_metric_name(name, task)
    import torchmetrics.classification as tc
    import torchmetrics.regression as tr

    kind, _, average = name.partition("_")
    # precision_macro -> MulticlassPrecision(average="macro"), or Multilabel... for labels
    averaged = {"precision": "Precision", "recall": "Recall", "f1": "F1Score"}
    if task == "multilabel":
        if name == "auroc":
            return tc.MultilabelAUROC(num_labels=num_outputs)
        return getattr(tc, f"Multilabel{averaged[kind]}")(num_labels=num_outputs, average=average)
    if task == "regression":
        if name == "mape":
            return tr.MeanAbsolutePercentageError()
        if name == "explained_variance":
            return tr.ExplainedVariance()
        return tr.PearsonCorrCoef(num_outputs=num_outputs)
    k = _top_k(name)
    if k:
        if k > num_outputs:
            raise ConfigError(
                f"config: train.metrics {name!r} needs k <= the number of classes "
                f"({num_outputs}); use a smaller k"
            )
        return tc.MulticlassAccuracy(num_classes=num_outputs, top_k=k, average="micro")
    if name == "balanced_accuracy":
        return tc.MulticlassAccuracy(num_classes=num_outputs, average="macro")
    if name == "auroc":
        return tc.MulticlassAUROC(num_classes=num_outputs)
    return getattr(tc, f"Multiclass{averaged[kind]}")(num_classes=num_outputs, average=average)


def _top_k(name: str) -> int:
    match = re.fullmatch(r"top(\d+)_accuracy", name)
    return int(match.group(1)) if match else 0
