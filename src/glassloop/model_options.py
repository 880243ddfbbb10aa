"""The ``[model]`` section of a config: which built-in model and its sizes, or your own class.
Owned here, torch-free, next to :mod:`glassloop.models` that builds it (so that reading a
config imports no torch); :mod:`glassloop.config` composes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glassloop.options import option
from glassloop.rules import FRACTION, Range

# The built-in models, and the [model] keys each reads (model.kwargs is for a model.target
# class).
BUILT_IN_KEYS = {
    "mlp": ("hidden", "dropout"),
    "cnn": ("dropout",),
    "text-classifier": ("embed_dim", "encoder", "num_layers", "num_heads", "dropout"),
}


@dataclass
class ModelConfig:
    """``name="mlp"`` (``hidden``, ``dropout``), ``name="text-classifier"`` (``embed_dim``,
    ``encoder``, ``num_layers``, ``num_heads``, ``dropout``), or ``target="pkg.module:Class"``
    / ``"path/to/file.py:Class"`` with ``kwargs`` for your own model."""

    name: str = option("mlp", rule=tuple(BUILT_IN_KEYS))
    hidden: list[int] = option([512, 512], rule=Range(1, 2**20))
    dropout: float = option(0.0, rule=FRACTION)
    target: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    # text-classifier: embedding + encoder ("gru" or "transformer") + masked mean pooling
    embed_dim: int = option(64, rule=Range(1, 2**16))
    encoder: str = option("gru", rule=("gru", "transformer"))
    num_layers: int = option(1, rule=Range(1, 1024))
    num_heads: int = option(4, rule=Range(1, 1024))
