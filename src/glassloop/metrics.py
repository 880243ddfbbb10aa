"""Streaming evaluation sums: sample-weighted loss, a confusion matrix, the class report.

Why hand-written instead of torchmetrics: the whole state is two sums and one ``C x C``
count matrix that stay on the device (no host sync per batch) and reduce across ranks with
one ``all_reduce``; precision, recall, F1 and accuracy are exact functions of that matrix.
The tests check every number against ``sklearn.metrics.classification_report``.
"""

from __future__ import annotations

from typing import Any

import torch

from glassloop.errors import DataError


class ClassificationSums:
    """Running loss sum, sample count and confusion matrix (rows: true, columns: predicted).

    >>> sums = ClassificationSums(num_classes=3, device=torch.device("cpu"))
    >>> sums.update(torch.tensor(0.5), torch.eye(3), torch.tensor([0, 1, 1]))
    >>> sums.compute()["accuracy"]
    0.6666666666666666
    """

    def __init__(self, num_classes: int | None, device: torch.device) -> None:
        self.num_classes = num_classes
        self.device = device
        # float64 so that 10^6 samples of float32 losses still average to 1e-9.
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.num_samples = 0
        self.num_invalid = torch.zeros((), dtype=torch.int64, device=device)
        self.confusion: torch.Tensor | None = None
        if num_classes is not None:
            self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)

    def update(self, mean_loss: torch.Tensor, output: torch.Tensor, target: Any) -> None:
        """Add a batch: its mean loss (weighted by its size), logits ``[N, C]``, labels ``[N]``."""
        n = int(target.shape[0]) if isinstance(target, torch.Tensor) else int(output.shape[0])
        # The loss is a per-sample mean, so mean * n is the batch's sum: the epoch average is
        # then over samples, not the mean of batch means (which over-weights a short last batch).
        self.loss_sum += mean_loss.detach().to(torch.float64) * n
        self.num_samples += n
        if self.confusion is None or not is_class_labels(output, target):
            return
        c = self.num_classes
        assert c is not None
        pred = output.argmax(dim=1)
        valid = (target >= 0) & (target < c)
        # Counted on the device and checked once at the end: no host sync per batch.
        self.num_invalid += (~valid).sum()
        index = target[valid] * c + pred[valid]
        self.confusion += torch.bincount(index, minlength=c * c).view(c, c)

    def all_reduce(self) -> None:
        """Sum the counts of every process (each evaluated its own shard): the result equals
        one process evaluating all the data. A no-op in a single process."""
        from glassloop.distributed import all_reduce

        sums = torch.stack([
            self.loss_sum.cpu(), torch.tensor(float(self.num_samples), dtype=torch.float64),
            self.num_invalid.cpu().to(torch.float64),
        ])  # fmt: skip
        all_reduce(sums)
        self.loss_sum = sums[0].to(self.device)
        self.num_samples = int(sums[1])
        self.num_invalid = sums[2].to(torch.int64).to(self.device)
        if self.confusion is not None:
            self.confusion = all_reduce(self.confusion.cpu()).to(self.device)

    def compute(self) -> dict[str, Any]:
        """Return ``loss`` (mean over samples), ``accuracy``, ``confusion`` and ``report``."""
        if self.num_samples == 0:
            raise DataError("data: the evaluation set is empty")
        result: dict[str, Any] = {"loss": float(self.loss_sum) / self.num_samples}
        if self.confusion is None:
            return result
        invalid = int(self.num_invalid)
        if invalid:
            raise DataError(
                f"data: {invalid} evaluation label(s) outside [0, {self.num_classes}) for a "
                f"model with {self.num_classes} outputs; check the labels or the model's "
                "output size"
            )
        confusion = self.confusion.cpu()
        total = int(confusion.sum())
        if total == 0:
            return result
        result["accuracy"] = int(confusion.diag().sum()) / total
        result["confusion"] = confusion.tolist()
        result["report"] = classification_report(confusion)
        return result


def is_class_labels(output: torch.Tensor, target: Any) -> bool:
    """True for classification: logits ``[N, C]`` and integer labels ``[N]``."""
    return (
        isinstance(target, torch.Tensor)
        and output.ndim == 2
        and target.ndim == 1
        and not target.dtype.is_floating_point
        and target.dtype != torch.bool
    )


def classification_report(confusion: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per-class precision, recall, F1 and support, plus macro and weighted averages.

    Equal to ``sklearn.metrics.classification_report(y_true, y_pred,
    labels=range(C), output_dict=True, zero_division=0)`` (keys ``"0"``..``"C-1"``).
    """
    cm = confusion.to(torch.float64)
    tp = cm.diag()
    support = cm.sum(dim=1)
    predicted = cm.sum(dim=0)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), 0.0)
    recall = torch.where(support > 0, tp / support.clamp(min=1), 0.0)
    # 2TP / (2TP + FP + FN), the form scikit-learn uses, so the numbers agree to the last bit.
    f1_denom = support + predicted
    f1 = torch.where(f1_denom > 0, 2 * tp / f1_denom.clamp(min=1), 0.0)
    total = float(support.sum())
    report: dict[str, dict[str, float]] = {}
    for c in range(cm.shape[0]):
        report[str(c)] = {
            "precision": float(precision[c]),
            "recall": float(recall[c]),
            "f1-score": float(f1[c]),
            "support": float(support[c]),
        }
    weights = support / total
    report["macro avg"] = {
        "precision": float(precision.mean()),
        "recall": float(recall.mean()),
        "f1-score": float(f1.mean()),
        "support": total,
    }
    report["weighted avg"] = {
        "precision": float((precision * weights).sum()),
        "recall": float((recall * weights).sum()),
        "f1-score": float((f1 * weights).sum()),
        "support": total,
    }
    return report


def format_report(
    report: dict[str, dict[str, float]],
    accuracy: float,
    class_names: list[str] | None = None,
) -> str:
    """Render the report as text in scikit-learn's layout."""
    classes = [k for k in report if k not in ("macro avg", "weighted avg")]
    names = [
        class_names[int(k)] if class_names is not None and int(k) < len(class_names) else k
        for k in classes
    ]
    width = max(len("weighted avg"), *(len(n) for n in names))
    head = f"{'':>{width}} {'precision':>9} {'recall':>9} {'f1-score':>9} {'support':>9}"
    lines = [head, ""]

    def row(name: str, r: dict[str, float]) -> str:
        return (
            f"{name:>{width}} {r['precision']:>9.4f} {r['recall']:>9.4f} "
            f"{r['f1-score']:>9.4f} {int(r['support']):>9d}"
        )

    lines += [row(name, report[k]) for name, k in zip(names, classes, strict=True)]
    total = int(report["macro avg"]["support"])
    lines += ["", f"{'accuracy':>{width}} {'':>9} {'':>9} {accuracy:>9.4f} {total:>9d}"]
    lines += [row("macro avg", report["macro avg"]), row("weighted avg", report["weighted avg"])]
    return "\n".join(lines)


def is_number(value: Any) -> bool:
    """A metric value: an int or float, not a bool (a row also holds strings and lists)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def monitor_mode(monitor: str, mode: str = "auto") -> str:
    """``"max"`` or ``"min"``: which way ``monitor`` improves. ``"auto"`` maximises metrics
    named like accuracy or F1 and minimises the rest (losses).

    >>> monitor_mode("val_accuracy"), monitor_mode("val_loss"), monitor_mode("val_loss", "max")
    ('max', 'min', 'max')
    """
    if mode == "auto":
        return "max" if "accuracy" in monitor or "f1" in monitor else "min"
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
