"""Model-only export to safetensors, and rebuilding a model from such a file (no pickle).

An exported file holds the weights plus, in its safetensors metadata, the model section of
the config, the input shape, the number of classes and class names (``glassloop.model``) and
the whole resolved config (``glassloop.config``): enough to rebuild and evaluate the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from glassloop.checkpoint import (
    CheckpointError,
    atomic_path,
    find_resumable,
    load_weights,
    read_checkpoint,
    read_safetensors_header,
    write_safetensors,
)
from glassloop.config import ModelConfig
from glassloop.models import build_model


def locate_weights(source: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """The weights file and resolved config for a run directory (its final weights, else its
    newest valid checkpoint), a checkpoint directory, or a ``.safetensors`` file."""
    source = Path(source)
    if source.is_file():
        read_safetensors_header(source)
        metadata = _metadata(source)
        config = (
            json.loads(metadata["glassloop.config"]) if "glassloop.config" in metadata else None
        )
        return source, config
    if (source / "manifest.json").is_file():
        checkpoint = read_checkpoint(source)
        return checkpoint.weights, checkpoint.meta.get("config")
    if (source / "config.json").is_file():
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        if (source / "model.safetensors").is_file():
            return source / "model.safetensors", config
        found, _ = find_resumable(source)
        if found is not None:
            return found.weights, config
        raise CheckpointError(f"checkpoint: run '{source}' has no weights yet (no checkpoint)")
    raise CheckpointError(
        f"checkpoint: '{source}' is not a run directory, a checkpoint or a .safetensors file"
    )


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as handle:
        return dict(handle.metadata() or {})


def export_model(source: str | Path, output: str | Path) -> Path:
    """Write the weights of ``source`` (see :func:`locate_weights`) to ``output`` with the
    model description in the metadata; return ``output``."""
    weights, config = locate_weights(source)
    metadata = _metadata(weights)
    if config is not None:
        metadata["glassloop.config"] = json.dumps(config)
    if "glassloop.model" not in metadata:
        raise CheckpointError(
            f"checkpoint: '{weights}' does not describe its model (trained without a config); "
            "save it with glassloop.save_weights and rebuild the model in code"
        )
    tensors = load_file(str(weights))
    output = Path(output)
    with atomic_path(output) as tmp:
        write_safetensors(tensors, tmp, metadata)
        tmp.chmod(0o644)
    return output


def model_description(path: str | Path) -> dict[str, Any]:
    """The ``glassloop.model`` metadata of a weights file."""
    path = Path(path)
    read_safetensors_header(path)
    metadata = _metadata(path)
    if "glassloop.model" not in metadata:
        raise CheckpointError(
            f"checkpoint: '{path}' has no glassloop model description; build the model in code "
            "and call glassloop.load_weights(model, path)"
        )
    spec: dict[str, Any] = json.loads(metadata["glassloop.model"])
    return spec


def load_model(path: str | Path) -> nn.Module:
    """Rebuild the model described in a glassloop weights file and load its weights, in eval
    mode. No pickle is involved (a ``model.target`` class is imported from its module).

    Example::

        model = glassloop.load_model("runs/demo/model.safetensors")
        probs = glassloop.predict(model, images)
    """
    spec = model_description(path)
    model = build_model(
        ModelConfig(**spec["model"]),
        tuple(spec["input_shape"]),
        int(spec["num_classes"]),
        vocab_size=int(spec.get("vocab_size", 0)),
        pad_id=int(spec.get("pad_id", 0)),
    )
    load_weights(model, Path(path))
    return model.eval()
