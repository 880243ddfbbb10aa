"""The one shape every dataset reader returns: training and validation tensors in memory plus
what the model and prediction need to know about them (:class:`Splits`), and the stratified
split that readers use when a dataset has no fixed validation set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from glassloop.errors import DataError


@dataclass
class Splits:
    """Training and validation tensors plus what the model needs to know about them."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int
    class_names: list[str]
    # How raw inputs were transformed (e.g. standardisation statistics of the training
    # split); saved with the weights so that prediction transforms new inputs the same way.
    preprocessing: dict[str, Any] = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def from_arrays(
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_va: np.ndarray,
    y_va: np.ndarray,
    class_names: list[str] | int,
    preprocessing: dict[str, Any] | None = None,
    *,
    values: bool = False,
) -> Splits:
    """float32 inputs and int64 labels (``values``: float32 targets, one column per output,
    for a regression or multilabel task); ``class_names`` may be a count (names "0", "1",
    ...) and names the outputs for ``values``.

    >>> s = from_arrays(np.zeros((4, 2)), np.arange(4), np.zeros((2, 2)), np.arange(2), 4)
    >>> s.class_names, s.x_train.dtype, s.input_shape
    (['0', '1', '2', '3'], torch.float32, (2,))
    """
    names = [str(c) for c in range(class_names)] if isinstance(class_names, int) else class_names
    y_dtype = torch.float32 if values else torch.int64
    preprocessing = dict(preprocessing or {})
    token_ids = preprocessing.get("inputs") == "token_ids"
    x_dtype = torch.int64 if token_ids else torch.float32  # an embedding's input stays integer
    if not token_ids and len(x_tr) and "mean" not in preprocessing:
        # What an input's mean looks like in training, for predict's "far from the training
        # data" warning on data that is not standardised (sources that standardise compare
        # against 0 instead).
        means = np.asarray(x_tr, dtype=np.float64).reshape(len(x_tr), -1).mean(axis=1)
        preprocessing["example_means"] = [float(means.min()), float(means.max())]
    return Splits(
        torch.as_tensor(x_tr, dtype=x_dtype),
        torch.as_tensor(y_tr, dtype=y_dtype),
        torch.as_tensor(x_va, dtype=x_dtype),
        torch.as_tensor(y_va, dtype=y_dtype),
        len(names),
        names,
        preprocessing,
    )


# More classes than this and than rows is no classification: integer labels are class
# indices 0..C-1, and one label of 10**12 built 10**12 class names (23 GB, killed by the OS).
MIN_CLASS_LIMIT = 1024


def check_class_count(largest: int, rows: int, where: str) -> int:
    """The number of classes integer labels up to ``largest`` make (``largest + 1``), checked
    against the data's size before anything is built from it.

    >>> check_class_count(9, 100, "'d.csv'")
    10
    >>> check_class_count(10**12, 600, "'d.parquet' column 'label'")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    glassloop.errors.DataError: data: 'd.parquet' column 'label' has a label of 1000000000000 ...
    """
    if largest + 1 > max(rows, MIN_CLASS_LIMIT):
        raise DataError(
            f"data: {where} has a label of {largest} for {rows} rows: integer labels are "
            f"class indices 0..C-1 (at most max(rows, {MIN_CLASS_LIMIT}) classes); for IDs or "
            "codes, store them as strings (each distinct value becomes a class)"
        )
    return largest + 1


def stratified_split(
    x: np.ndarray, y: np.ndarray, *, val_size: float | int, seed: int, stratify: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's ``train_test_split``, stratified by class unless ``stratify`` is false
    (real-valued or multi-column targets): (x_train, y_train, x_val, y_val)."""
    from sklearn.model_selection import train_test_split  # ~1 s to import: only when used

    try:
        x_tr, x_va, y_tr, y_va = train_test_split(
            x, y, test_size=val_size, random_state=seed, stratify=y if stratify else None
        )
    except ValueError as err:
        raise DataError(f"data: cannot split {len(y)} samples for validation: {err}") from err
    return x_tr, y_tr, x_va, y_va


def target_values(y: np.ndarray, task: str, where: str) -> np.ndarray:
    """Targets of a regression or multilabel task as float32 ``(N, outputs)``: finite, and
    0/1 for multilabel."""
    values = np.asarray(y, dtype=np.float64)
    if values.ndim == 1:
        values = values[:, None]  # one output: (N, 1), the shape of the model's output
    if not np.isfinite(values).all():
        raise DataError(f"data: {where} has NaN or infinite target values")
    if task == "multilabel" and not np.isin(values, (0.0, 1.0)).all():
        raise DataError(f"data: {where}: multilabel targets must be 0 or 1 per label")
    return values.astype(np.float32)
