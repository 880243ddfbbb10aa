"""Choosing the device and moving a batch (tensor, tuple, list or dict of tensors) onto it."""

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
    """Move every tensor in ``batch`` to ``device``; other values pass through unchanged.

    Pinned tensors are copied with ``non_blocking=True`` so the copy overlaps compute.

    >>> move_to_device({"x": torch.zeros(2)}, torch.device("cpu"))["x"].device.type
    'cpu'
    """
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, tuple):
        return tuple(move_to_device(item, device) for item in batch)
    if isinstance(batch, list):
        return [move_to_device(item, device) for item in batch]
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch
