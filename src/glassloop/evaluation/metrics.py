"""Streaming evaluation sums per task: a confusion matrix and the class report
(classification), per-label counts (multilabel), error sums (regression).

Why hand-written instead of torchmetrics for these defaults: each state is a few sums that stay
on the device (no host sync per batch), reduce across processes with one ``all_reduce`` each,
and the metrics are exact functions of them; the tests check every number against
scikit-learn (``classification_report``, ``f1_score``, ``r2_score``, ...). Any other metric
is a torchmetrics object (:mod:`glassloop.evaluation.metric_names`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from glassloop.errors import DataError

# Above this many classes (a language model's vocabulary) no C x C confusion matrix is kept
# (50,000 classes would take 20 GB); accuracy is counted directly.
CONFUSION_MAX_CLASSES = 1024


class Sums:
    """Named float64 tensors that add up over batches and across processes (float64: 10^6
    float32 values still add up to 1e-9)."""

    def __init__(self, device: torch.device, **shapes: tuple[int, ...]) -> None:
        self.sums = {
            name: torch.zeros(shape, dtype=torch.float64, device=device)
            for name, shape in shapes.items()
        }

    def all_reduce(self) -> None:
        """Add every process's sums (each evaluated its own shard): the result equals one
        process evaluating all the data."""
        from glassloop.distributed.world import all_reduce

        for name, value in self.sums.items():
            self.sums[name] = all_reduce(value.cpu()).to(value.device)


class ClassificationSums(Sums):
    """Class scores ``[M, C]`` against labels ``[M]``: a confusion matrix (rows: true, columns:
    predicted; up to :data:`CONFUSION_MAX_CLASSES` classes) and the correct count. Labels
    equal to ``ignore_index`` (padding tokens) are left out.

    >>> sums = ClassificationSums(3, torch.device("cpu"))
    >>> sums.update(torch.eye(3), torch.tensor([0, 1, 1]))
    >>> sums.compute()["accuracy"]
    0.6666666666666666
    """

    def __init__(self, num_classes: int, device: torch.device, ignore_index: int = -100) -> None:
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.keep_confusion = num_classes <= CONFUSION_MAX_CLASSES
        # One extra cell collects the left-out labels, so nothing is indexed by a mask (a
        # boolean index waits for the GPU to count it).
        cells = num_classes * num_classes + 1 if self.keep_confusion else 1
        super().__init__(device, confusion=(cells,), correct=(), counted=(), invalid=())

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        c = self.num_classes
        predicted = scores.argmax(dim=-1)
        kept = labels != self.ignore_index
        valid = kept & (labels >= 0) & (labels < c)
        self.sums["invalid"] += (kept & ~valid).sum()  # checked once, at the end
        self.sums["counted"] += valid.sum()
        self.sums["correct"] += (valid & (predicted == labels)).sum()
        if self.keep_confusion:
            cell = torch.where(valid, labels * c + predicted, c * c)
            ones = torch.ones_like(cell, dtype=torch.float64)
            self.sums["confusion"].index_add_(0, cell, ones)

    def accuracy(self) -> float | None:
        """The share of counted labels predicted right so far (one host read); ``None``
        before any (also what a progress bar shows while the sums grow)."""
        correct, counted = torch.stack([self.sums["correct"], self.sums["counted"]]).tolist()
        return correct / counted if counted else None

    def compute(self) -> dict[str, Any]:
        """``accuracy`` and, up to :data:`CONFUSION_MAX_CLASSES` classes, ``confusion`` and
        ``report`` (per-class precision/recall/F1/support)."""
        invalid = int(self.sums["invalid"])
        c = self.num_classes
        if invalid:
            raise DataError(
                f"data: {invalid} evaluation label(s) outside [0, {c}) for a model with {c} "
                "outputs; check the labels or the model's output size"
            )
        accuracy = self.accuracy()
        if accuracy is None:
            return {}
        result: dict[str, Any] = {"accuracy": accuracy}
        if self.keep_confusion:
            confusion = self.sums["confusion"][:-1].view(c, c).to(torch.int64).cpu()
            result["confusion"] = confusion.tolist()
            result["report"] = classification_report(confusion)
        return result


class MultilabelSums(Sums):
    """Logits ``[N, L]`` against 0/1 targets ``[N, L]``, each label decided at probability
    0.5: per-label true/false positives/negatives and whole-sample matches.

    ``accuracy`` is over all label decisions (scikit-learn's ``1 - hamming_loss``),
    ``exact_match`` the share of samples with every label right (``accuracy_score``),
    ``f1_micro`` / ``f1_macro`` as ``f1_score(average=...)`` with ``zero_division=0``.
    """

    def __init__(
        self, num_labels: int, device: torch.device, *, probabilities: bool = False
    ) -> None:
        shape = (num_labels,)
        super().__init__(device, tp=shape, fp=shape, fn=shape, tn=shape, exact=(), samples=())
        # Logits are decided at 0 (sigmoid(0) = 0.5); probabilities (BCELoss) at 0.5.
        self.threshold = 0.5 if probabilities else 0.0

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        if logits.ndim == 1:  # one label per sample, (N,)
            logits, target = logits[:, None], target[:, None]
        predicted = logits > self.threshold
        truth = target > 0.5
        self.sums["tp"] += (predicted & truth).sum(0)
        self.sums["fp"] += (predicted & ~truth).sum(0)
        self.sums["fn"] += (~predicted & truth).sum(0)
        self.sums["tn"] += (~predicted & ~truth).sum(0)
        self.sums["exact"] += (predicted == truth).all(dim=1).sum()
        self.sums["samples"] += predicted.shape[0]

    def compute(self) -> dict[str, Any]:
        tp, fp, fn, tn = (self.sums[k].cpu() for k in ("tp", "fp", "fn", "tn"))
        samples = float(self.sums["samples"])
        if samples == 0:
            return {}
        per_label = 2 * tp + fp + fn
        f1 = torch.where(per_label > 0, 2 * tp / per_label.clamp(min=1), 0.0)
        micro = float(2 * tp.sum() + fp.sum() + fn.sum())
        return {
            "accuracy": float((tp + tn).sum() / (tp + fp + fn + tn).sum()),
            "exact_match": float(self.sums["exact"]) / samples,
            "f1_micro": float(2 * tp.sum()) / micro if micro else 0.0,
            "f1_macro": float(f1.mean()),
        }


class RegressionSums(Sums):
    """Predictions against targets of the same shape ``[N, ...]``: ``mae``, ``rmse`` and
    ``r2`` (per output, averaged over outputs: scikit-learn's ``uniform_average``).

    The targets' sums are kept around a shift (the first batch's mean): one-pass sums of
    targets near 1e6 +- 1 lose R2's fourth digit (0.910511 for scikit-learn's 0.910623)
    and near 1e8 all of it; around the shift they are exact to float64."""

    def __init__(self, num_outputs: int, device: torch.device) -> None:
        shape = (num_outputs,)
        super().__init__(device, abs=shape, sq=shape, y=shape, y2=shape, n=())
        self.shift: torch.Tensor | None = None

    def update(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        p = prediction.detach().reshape(prediction.shape[0], -1).double()
        y = target.reshape(target.shape[0], -1).double()
        if self.shift is None:
            self.shift = y.mean(0)
        error = p - y
        centred = y - self.shift
        self.sums["abs"] += error.abs().sum(0)
        self.sums["sq"] += error.square().sum(0)
        self.sums["y"] += centred.sum(0)
        self.sums["y2"] += centred.square().sum(0)
        self.sums["n"] += p.shape[0]

    def all_reduce(self) -> None:
        """Each process's sums moved to one common shift (the mean of theirs), then added."""
        from glassloop.distributed.world import all_reduce

        y = self.sums["y"]
        own = self.shift if self.shift is not None else torch.zeros_like(y)
        has_data = float(self.shift is not None)
        shifts = all_reduce(torch.cat([own * has_data, own.new_tensor([has_data])]).cpu())
        common = (shifts[:-1] / shifts[-1].clamp(min=1)).to(y.device)
        moved = own - common  # sum((t - c)^2) = sum((t - s)^2) + 2 (s - c) sum(t - s) + n (s - c)^2
        n = self.sums["n"]
        self.sums["y2"] = self.sums["y2"] + 2 * moved * y + n * moved.square()
        self.sums["y"] = y + n * moved
        self.shift = common
        super().all_reduce()

    def compute(self) -> dict[str, Any]:
        n = float(self.sums["n"])
        if n == 0:
            return {}
        sq, y, y2 = (self.sums[k].cpu() for k in ("sq", "y", "y2"))
        total = y2 - y.square() / n  # sum of squares around the mean
        # sklearn: a constant target gives r2 = 1 for a perfect fit, else 0.
        r2 = torch.where(total > 0, 1 - sq / total.clamp(min=1e-300), (sq == 0).double())
        return {
            "mae": float(self.sums["abs"].sum()) / (n * len(y)),
            "rmse": float(torch.sqrt(sq / n).mean()),
            "r2": float(r2.mean()),
        }


def classification_report(confusion: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per-class precision, recall, F1 and support, plus macro and weighted averages.

    Equal to ``sklearn.metrics.classification_report(y_true, y_pred,
    labels=range(C), output_dict=True, zero_division=0)`` (keys ``"0"``..``"C-1"``), to the
    last bit: the same float64 operations in the same order (numpy's ``mean`` and
    ``average``, as scikit-learn's averages; a tensor sum adds in another order).
    """
    cm = confusion.to(torch.float64).cpu().numpy()
    tp = cm.diagonal()
    support = cm.sum(axis=1)
    predicted = cm.sum(axis=0)
    precision = np.where(predicted > 0, tp / np.maximum(predicted, 1), 0.0)
    recall = np.where(support > 0, tp / np.maximum(support, 1), 0.0)
    # 2TP / (2TP + FP + FN), the form scikit-learn uses.
    f1_denom = support + predicted
    f1 = np.where(f1_denom > 0, 2 * tp / np.maximum(f1_denom, 1), 0.0)
    total = float(support.sum())
    report: dict[str, dict[str, float]] = {}
    for c in range(cm.shape[0]):
        report[str(c)] = {
            "precision": float(precision[c]),
            "recall": float(recall[c]),
            "f1-score": float(f1[c]),
            "support": float(support[c]),
        }
    report["macro avg"] = {
        "precision": float(np.average(precision)),
        "recall": float(np.average(recall)),
        "f1-score": float(np.average(f1)),
        "support": total,
    }
    weights = support if total else None  # (no samples: numpy refuses all-zero weights)
    report["weighted avg"] = {
        "precision": float(np.average(precision, weights=weights)),
        "recall": float(np.average(recall, weights=weights)),
        "f1-score": float(np.average(f1, weights=weights)),
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
