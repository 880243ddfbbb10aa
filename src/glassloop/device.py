"""Choosing the device and moving a batch (tensors in any nesting of tuples, lists, dicts,
namedtuples and dataclasses) onto it."""

from __future__ import annotations

from typing import Any

import torch

from glassloop.errors import ConfigError


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn ``"auto"`` into CUDA, then MPS, then CPU; check that an explicit device exists.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ConfigError(
            f"train.device: {device!r} is not a device (expected 'auto', 'cpu', 'cuda', "
            "'cuda:N' or 'mps')"
        ) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device: {device!r} was asked for but CUDA is not available here "
            "(use 'auto' or 'cpu')"
        )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"train.device: {device!r} was asked for but MPS is not available here")
    return resolved


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` to ``device``, keeping every container's type
    (namedtuples, dataclasses, ``Mapping`` types such as a tokenizer's ``BatchEncoding``);
    other values pass through unchanged.

    Pinned tensors are copied with ``non_blocking=True`` so the copy overlaps compute. Plain
    tuples, lists and dicts (what loaders yield) take a short path; anything else goes
    through ``lightning_utilities.apply_to_collection``.

    >>> from collections import namedtuple
    >>> Pair = namedtuple("Pair", "x y")
    >>> moved = move_to_device(Pair(torch.zeros(2), 1), torch.device("cpu"))
    >>> type(moved).__name__, moved.x.device.type
    ('Pair', 'cpu')
    """
    kind = type(batch)
    if kind is list or kind is tuple:  # (a tensor already there: no call per item)
        moved = [
            x if type(x) is torch.Tensor and x.device == device else move_to_device(x, device)
            for x in batch
        ]
        return moved if kind is list else tuple(moved)
    if kind is torch.Tensor or isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.is_pinned())
    if kind is dict:
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (str, bytes, int, float, bool)) or batch is None:
        return batch
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor, move_to_device, device)
