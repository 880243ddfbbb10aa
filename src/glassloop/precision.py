"""Mixed precision: ``"32"`` | ``"bf16"`` | ``"fp16"`` → an autocast context and a GradScaler.

* ``"32"``: no autocast, a disabled scaler (the hand-written loop, bit for bit).
* ``"bf16"``: ``torch.autocast(dtype=bfloat16)``; bf16 has fp32's range, so no loss scaling.
* ``"fp16"``: ``torch.autocast(dtype=float16)`` plus ``torch.amp.GradScaler``: the loss is
  scaled before backward so small gradients survive fp16, gradients are unscaled before
  clipping, and a step whose gradients overflowed is skipped (and the scale lowered).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from glassloop.errors import ConfigError

PRECISIONS = ("32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: torch.device) -> str | None:
    """Refuse a precision the device cannot run, with what to use instead; a warning line
    for one it runs slowly (``None``: none)."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"config: train.precision must be one of {', '.join(PRECISIONS)}; got {precision!r}"
        )
    if precision == "32":
        return None
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise ConfigError(
            f"config: train.precision = {precision!r} needs autocast, which {device.type} "
            "does not support; use '32'"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "config: train.precision = 'bf16' is not supported by this GPU; use 'fp16' or '32'"
        )
    if precision == "fp16" and device.type == "mps":
        raise ConfigError(
            "config: train.precision = 'fp16' (with a GradScaler) is not supported on MPS here; "
            "use 'bf16' or '32'"
        )
    if precision == "fp16" and device.type == "cpu":
        return (
            "warning: fp16 on a CPU is emulated and slow (11x slower than '32' on the "
            "tutorial MLP in docs/benchmarks.md); 'bf16' is the CPU's mixed precision"
        )
    return None


NO_AUTOCAST = contextlib.nullcontext()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The forward-pass context for ``precision``: ``torch.autocast``, or a no-op for
    ``"32"`` (a ``nullcontext``: it costs nothing per step).

    >>> with autocast("bf16", torch.device("cpu")):
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
    torch.bfloat16
    """
    if precision == "32":
        return NO_AUTOCAST  # (one shared object: nullcontext is reusable)
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled for ``"fp16"`` only. Disabled, each of its calls returns at once
    (``scale`` gives the loss back, ``step`` is ``optimizer.step()``): the step needs no
    ``if scaler`` branch, as in nanoGPT.

    >>> scaler = make_scaler("32", torch.device("cpu"))
    >>> loss = torch.ones(()); scaler.scale(loss) is loss, scaler.is_enabled()
    (True, False)
    """
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
