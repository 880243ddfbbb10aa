"""What "best" means, in one place: the epoch whose ``checkpoint.monitor`` metric (default
``val_loss``, or ``train_loss`` without validation) is best, maximised for metrics named like
accuracy or F1 and minimised otherwise (or as ``checkpoint.mode`` says). The end summary, the
report, ``glassloop runs``, ``RUN_DIR/best/`` and early stopping's direction all use it, and
every place that prints a best names its metric."""

from __future__ import annotations

import math
from typing import Any

# Words in a metric's name that mean "higher is better"; every other metric (losses, mae,
# rmse, perplexity) is minimised.
HIGHER_IS_BETTER = ("accuracy", "f1", "r2", "exact_match", "auroc", "precision", "recall")


def monitor_mode(monitor: str, mode: str = "auto") -> str:
    """``"max"`` or ``"min"``: which way ``monitor`` improves. ``"auto"`` maximises metrics
    named like accuracy or F1 and minimises the rest (losses).

    >>> monitor_mode("val_accuracy"), monitor_mode("val_loss"), monitor_mode("val_loss", "max")
    ('max', 'min', 'max')
    """
    if mode == "auto":
        return "max" if any(word in monitor for word in HIGHER_IS_BETTER) else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
    return mode


def improves(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (the first value always does).

    >>> improves(0.5, None, "min"), improves(0.5, 0.4, "min"), improves(0.5, 0.4, "max", 0.2)
    (True, False, False)
    """
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


def best_epoch(
    history: list[dict[str, Any]], monitor: str = "", mode: str = "auto"
) -> tuple[str, float, int] | None:
    """``(metric, value, epoch)`` of the best epoch row by ``monitor`` (or val_loss, or
    train_loss when there is no validation); the first of equal values, as ``best/`` keeps.

    >>> best_epoch([{"epoch": 1, "val_loss": 0.5}, {"epoch": 2, "val_loss": 0.4}])
    ('val_loss', 0.4, 2)
    """
    if not history:
        return None
    name = monitor or ("val_loss" if any("val_loss" in row for row in history) else "train_loss")
    direction = monitor_mode(name, mode)
    best: tuple[str, float, int] | None = None
    for row in history:
        value = row.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or "epoch" not in row:
            continue
        if math.isfinite(value) and (best is None or improves(value, best[1], direction)):
            best = (name, float(value), int(row["epoch"]))
    return best


def shown(name: str, value: float) -> str:
    """A metric value as glassloop prints it: accuracies in percent.

    >>> shown("val_accuracy", 0.951), shown("val_loss", 0.17351)
    ('95.10%', '0.1735')
    """
    return f"{100 * value:.2f}%" if name.endswith("accuracy") else f"{value:.4g}"


def is_number(value: Any) -> bool:
    """A metric value: an int or float, not a bool (a row also holds strings and lists)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
