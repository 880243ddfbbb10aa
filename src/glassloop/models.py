"""Built-in models (the tutorial MLP) and loading a user's model class from config."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

from torch import nn

from glassloop.config import ModelConfig
from glassloop.errors import ModelError


def mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: list[int], dropout: float = 0.0
) -> nn.Sequential:
    """Flatten → (Linear → ReLU [→ Dropout]) per hidden size → Linear to logits.

    ``mlp((1, 28, 28), 10, [512, 512])`` is the "Learn the Basics" network; no softmax at the
    end, because ``CrossEntropyLoss`` applies log-softmax itself.

    >>> sum(p.numel() for p in mlp((1, 28, 28), 10, [512, 512]).parameters())
    669706
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def import_target(target: str) -> Any:
    """Import ``"package.module:Name"`` or ``"path/to/file.py:Name"``."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelError(
            f"model.target {target!r} must look like 'package.module:Class' or "
            "'path/to/file.py:Class'"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ModelError(f"model.target: file '{path}' not found")
            name = f"glassloop_user_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ModelError:
        raise
    except Exception as err:  # the user's module may raise anything while importing
        raise ModelError(
            f"model.target {target!r} could not be imported: {type(err).__name__}: {err}"
        ) from err
    if not hasattr(module, attr):
        raise ModelError(f"model.target {target!r}: module '{module_name}' has no '{attr}'")
    return getattr(module, attr)


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model the config names, for data of ``input_shape`` with ``num_classes`` classes."""
    if cfg.target:
        factory = import_target(cfg.target)
        try:
            model = factory(**cfg.kwargs)
        except Exception as err:  # the user's constructor may raise anything
            raise ModelError(
                f"model.target {cfg.target!r} could not be built with kwargs {cfg.kwargs}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"model.target {cfg.target!r} returned {type(model).__name__}, not a torch "
                "nn.Module"
            )
        return model
    if cfg.name == "mlp":
        return mlp(input_shape, num_classes, cfg.hidden, cfg.dropout)
    raise ModelError(
        f"model.name {cfg.name!r} is not a built-in model (built-in: 'mlp'); or set "
        "model.target = 'package.module:Class'"
    )
