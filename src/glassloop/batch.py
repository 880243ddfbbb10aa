"""How a batch is split into the model's inputs and the loss's target.

The convention (documented in the README):

* a tuple or list ``(x, y)`` calls ``model(x)``; ``(x1, x2, ..., y)`` calls ``model(x1, x2, ...)``;
  the last element is always the target;
* a dict calls ``model(**rest)`` with every key except the target key, which is the first of
  ``"labels"``, ``"label"``, ``"targets"``, ``"target"``, ``"y"`` present;
* a bare tensor is inputs only (for ``predict``).
"""

from __future__ import annotations

from typing import Any

import torch

from glassloop.errors import DataError

TARGET_KEYS = ("labels", "label", "targets", "target", "y")

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def split_batch(batch: Any) -> tuple[Inputs, Any]:
    """Return ``((args, kwargs), target)`` for a training or evaluation batch.

    >>> (args, kwargs), y = split_batch((torch.zeros(2, 3), torch.tensor([0, 1])))
    >>> args[0].shape, kwargs, y.tolist()
    (torch.Size([2, 3]), {}, [0, 1])
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise DataError(
                f"data: a training batch must be (inputs, target), got a {type(batch).__name__} "
                f"of length {len(batch)}"
            )
        return (tuple(batch[:-1]), {}), batch[-1]
    if isinstance(batch, dict):
        for key in TARGET_KEYS:
            if key in batch:
                kwargs = {k: v for k, v in batch.items() if k != key}
                return ((), kwargs), batch[key]
        raise DataError(
            f"data: a dict batch needs a target under one of {list(TARGET_KEYS)}, "
            f"got keys {sorted(batch)}"
        )
    raise DataError(
        "data: a training batch must be a tuple/list (inputs..., target) or a dict with a "
        f"'labels' key, got {type(batch).__name__}"
    )


def split_inputs(batch: Any) -> Inputs:
    """Return ``(args, kwargs)`` for ``predict``: a bare tensor is all input, else as above.

    >>> split_inputs(torch.zeros(1))[0][0].shape
    torch.Size([1])
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, dict) and not any(key in batch for key in TARGET_KEYS):
        return (), dict(batch)
    inputs, _ = split_batch(batch)
    return inputs


def batch_size_of(target: Any, inputs: Inputs) -> int:
    """Number of samples in a batch: the target's first dimension, else the first input's."""
    if isinstance(target, torch.Tensor) and target.ndim > 0:
        return int(target.shape[0])
    args, kwargs = inputs
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    raise DataError("data: cannot tell the batch size: no tensor with a batch dimension")


def describe_batch(batch: Any) -> str:
    """Shapes and dtypes of a batch, for error messages: ``(64, 1, 28, 28) float32``."""
    if isinstance(batch, torch.Tensor):
        return f"{tuple(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, (tuple, list)):
        return "(" + ", ".join(describe_batch(item) for item in batch) + ")"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {describe_batch(v)}" for k, v in batch.items()) + "}"
    return type(batch).__name__
