"""How a batch is split into the model's inputs and the loss's target.

The convention (documented in docs/python-api.md):

* a tuple or list ``(x, y)`` calls ``model(x)``; ``(x1, x2, ..., y)`` calls ``model(x1, x2, ...)``;
  the last element is always the target;
* a dict (any ``Mapping``: a tokenizer's ``BatchEncoding``, what ``DataCollatorWithPadding``
  returns) calls ``model(**rest)`` with every key except the target key, which is the first
  of ``"labels"``, ``"label"``, ``"targets"``, ``"target"``, ``"y"`` present;
* a bare tensor is inputs only (for ``predict``);
* when the model computes its own loss (``loss_fn=None``), the target is also passed to it as
  ``labels=`` (what Hugging Face models expect).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from glassloop.errors import DataError

TARGET_KEYS = ("labels", "label", "targets", "target", "y")

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def split_batch(batch: Any, *, labels_to_model: bool = False) -> tuple[Inputs, Any]:
    """Return ``((args, kwargs), target)`` for a training or evaluation batch;
    ``labels_to_model``: the model also gets the target as ``labels=`` (its own loss).

    >>> split_batch((torch.zeros(2), torch.ones(2)), labels_to_model=True)[0][1]["labels"]
    tensor([1., 1.])

    >>> (args, kwargs), y = split_batch((torch.zeros(2, 3), torch.tensor([0, 1])))
    >>> args[0].shape, kwargs, y.tolist()
    (torch.Size([2, 3]), {}, [0, 1])
    """
    kind = type(batch)
    if kind is list or kind is tuple or isinstance(batch, (tuple, list)):  # (a loader's: no call)
        if len(batch) < 2:
            raise DataError(
                f"data: a training batch must be (inputs, target), got a {type(batch).__name__} "
                f"of length {len(batch)}"
            )
        args, kwargs, target = tuple(batch[:-1]), {}, batch[-1]
    elif isinstance(batch, Mapping):
        key = next((key for key in TARGET_KEYS if key in batch), None)
        if key is None:
            raise DataError(
                f"data: a dict batch needs a target under one of {list(TARGET_KEYS)}, "
                f"got keys {sorted(batch)}"
            )
        args, kwargs, target = (), {k: v for k, v in batch.items() if k != key}, batch[key]
    else:
        raise DataError(
            "data: a training batch must be a tuple/list (inputs..., target) or a mapping with "
            f"a 'labels' key, got {type(batch).__name__}"
        )
    if labels_to_model:
        kwargs = {**kwargs, "labels": target}
    return (args, kwargs), target


def split_inputs(batch: Any, required_inputs: int | None = None) -> Inputs:
    """Return ``(args, kwargs)`` for ``predict``: a bare tensor is all input; a tuple with
    exactly ``required_inputs`` elements (the model's required positional arguments, see
    :func:`required_inputs`) is all input; otherwise as above (the last element, or the
    target key, is the target and is dropped).

    >>> split_inputs(torch.zeros(1))[0][0].shape
    torch.Size([1])
    >>> len(split_inputs((torch.zeros(1), torch.zeros(1)), required_inputs=2)[0])
    2
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping) and not any(key in batch for key in TARGET_KEYS):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == required_inputs:
        return tuple(batch), {}
    inputs, _ = split_batch(batch)
    return inputs


def required_inputs(model: nn.Module) -> int | None:
    """How many positional arguments ``model.forward`` requires (``None`` when it takes
    ``*args`` or cannot be inspected)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP, EMA
        model = model.module
    model = getattr(model, "_orig_mod", model)  # torch.compile
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    count = 0
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            return None
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        count += positional and p.default is p.empty
    return count


def batch_size_of(target: Any, inputs: Inputs) -> int:
    """Number of samples in a batch: the target's first dimension, else the first input's."""
    is_tensor = type(target) is torch.Tensor or isinstance(target, torch.Tensor)  # (1st: no call)
    if is_tensor and target.ndim > 0:
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
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {describe_batch(v)}" for k, v in batch.items()) + "}"
    return type(batch).__name__
