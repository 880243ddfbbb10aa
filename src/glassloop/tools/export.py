"""Model-only export to safetensors, and rebuilding a model from such a file (no pickle).

An exported file holds the weights plus, in its safetensors metadata, the model section of
the config, the input shape, the number of classes and class names (``glassloop.model``) and
the whole resolved config (``glassloop.config.schema``): enough to rebuild and evaluate the model.

Loading never runs code named inside a file. A built-in model (``mlp``, ``cnn``,
``text-classifier``) is rebuilt from numbers that are checked first (and on the ``meta``
device against the file's shapes, so ``hidden = [10**12]`` allocates nothing). A file that
names its own class (``model.target = "pkg.module:Class"``) is refused unless the caller
passes the class (``model_class=``) or says it trusts the file (``trust_code=True``, the CLI's
``--trust-code``): importing a module a file names is running code, as unpickling is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.config.assemble import located
from glassloop.config.models import build_model, data_kwargs, target_scale_of
from glassloop.config.schema import Config, from_dict, require_trust
from glassloop.config.sections import ModelConfig
from glassloop.errors import CheckpointError, ConfigError, ModelError
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import Checkpoint, find_resumable, read_checkpoint
from glassloop.run_dir.layout import SHARDS
from glassloop.storage.atomic import atomic_path
from glassloop.storage.frozen_base import METADATA_KEY as BASE_KEY
from glassloop.storage.frozen_base import recorded_names
from glassloop.storage.hashed_files import write_safetensors
from glassloop.storage.hugging_face import MAX_SHARD_BYTES, write_run_hf
from glassloop.storage.weights import (
    check_fit,
    load_onto,
    read_safetensors,
    safetensors_dtype,
)
from glassloop.tasks import TASK_ATTRIBUTE, TASKS
from glassloop.tracking.provenance import recorded_folder
from glassloop.tracking.runs import read_json

ModelClass = Callable[..., nn.Module]


@dataclass
class Weights:
    """The weights to evaluate, predict with or export, and where they came from."""

    path: Path  # the file (or checkpoint directory) they were read from
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    config: dict[str, Any] | None  # the run's resolved config, when known
    base: Any = None  # a fine-tuned run's record of the frozen base its tensors leave out


def read_weights(source: str | Path) -> Weights:
    """The weights of a run directory (its final weights, else its newest valid
    checkpoint), a checkpoint directory, or a ``.safetensors`` file. For a checkpoint of a
    run with ``train.ema_decay``, the EMA weights (what the run evaluates and exports), not
    the raw ones."""
    source = Path(source)
    if not os.path.lexists(source):
        raise CheckpointError(
            f"checkpoint: '{source}' not found (expected a run directory, a checkpoint or a "
            ".safetensors file)"
        )
    if source.is_file():
        tensors, metadata = read_safetensors(source)
        config = _json_field(metadata, "glassloop.config.schema", source)
        return Weights(source, tensors, metadata, config, metadata.get(BASE_KEY))
    if (source / layout.MANIFEST).is_file():
        checkpoint = read_checkpoint(source)
        config = checkpoint.meta.get("config")
    elif (source / layout.CONFIG).is_file():
        config = _json_file(source / layout.CONFIG)
        if (source / layout.WEIGHTS).is_file():
            final = source / layout.WEIGHTS
            tensors, metadata = read_safetensors(final)
            return Weights(final, tensors, metadata, config, metadata.get(BASE_KEY))
        found, problems = find_resumable(source)
        if found is None:
            detail = f": {'; '.join(problems)}" if problems else " (no checkpoint)"
            raise CheckpointError(f"checkpoint: run '{source}' has no valid weights{detail}")
        checkpoint = found
    else:
        raise CheckpointError(
            f"checkpoint: '{source}' is not a run directory, a checkpoint or a .safetensors file"
        )
    tensors = full_weights(checkpoint)  # verified with the checkpoint (FSDP: gathered)
    base = checkpoint.meta.get("base")  # (a fine-tuned run's: the frozen base left out)
    ema = checkpoint.state.get("ema")
    if isinstance(ema, dict):  # AveragedModel's state: "module.<key>" plus "n_averaged"
        tensors = {k[len("module.") :]: v for k, v in ema.items() if k.startswith("module.")}
        base = None  # (the average holds every tensor)
    if not isinstance(config, dict):
        config = None
    return Weights(checkpoint.path, tensors, checkpoint.model_metadata, config, base)


def full_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint's whole weights: ``model.safetensors``, or a sharded (FSDP) checkpoint's
    gathered from its shards (checked for NaN/inf as the reader checks model.safetensors)."""
    if not checkpoint.sharded:
        return checkpoint.model_tensors
    from glassloop.distributed.fsdp import read_full_weights  # torch.distributed, only when needed

    tensors = read_full_weights(checkpoint.path / SHARDS)
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        raise CheckpointError(
            f"checkpoint: '{checkpoint.path}': the shards hold NaN/inf values (in '{bad[0]}')"
        )
    return tensors


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)  # (a run directory's config.json: at most a few MB)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint: '{path}' is not readable JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint: '{path}' must hold a JSON object")
    return data


def _json_field(metadata: dict[str, str], key: str, path: Path) -> dict[str, Any] | None:
    if key not in metadata:
        return None
    try:
        value = json.loads(metadata[key])
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint: '{path}': metadata {key} is not JSON") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint: '{path}': metadata {key} is not a JSON object")
    return value


def export_model(source: str | Path, output: str | Path) -> Path:
    """Write the weights of ``source`` (see :func:`read_weights`) to ``output`` with the
    model description in the metadata; return ``output``. Nothing is imported or built."""
    weights = read_weights(source)
    metadata = dict(weights.metadata)
    if weights.config is not None:
        metadata["glassloop.config.schema"] = json.dumps(weights.config, sort_keys=True)
    if weights.base:  # the frozen base the tensors leave out: checked where they are loaded
        base = weights.base
        metadata[BASE_KEY] = base if isinstance(base, str) else json.dumps(base, sort_keys=True)
    if "glassloop.model" not in metadata:
        raise CheckpointError(
            f"checkpoint: '{weights.path}' does not describe its model (trained without a "
            "config); save it with glassloop.save_weights and rebuild the model in code"
        )
    output = Path(output)
    with atomic_path(output) as tmp:
        write_safetensors(weights.tensors, tmp, metadata)
        tmp.chmod(0o644)
    return output


def export_run_hf(
    source: str | Path,
    folder: str | Path,
    *,
    merged: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the final weights of the run ``source`` (a run directory or its
    ``model.safetensors``) into ``folder`` in Hugging Face layout, from the files alone:
    a transformers model's folder (in shards of at most ``max_shard_bytes`` above that), or
    a peft adapter's (:mod:`glassloop.storage.hugging_face`). For the merged model, call
    :func:`glassloop.export_hf` on the trained model (``merged=True`` here says so)."""
    weights = read_weights(source)
    return write_run_hf(
        weights.tensors,
        weights.metadata,
        Path(folder),
        weights.path,
        merged=merged,
        max_shard_bytes=max_shard_bytes,
    )


def model_description(weights: Weights) -> dict[str, Any]:
    """The ``glassloop.model`` metadata of a weights file, checked: a model section that
    passes the config's own validation (a file ``model.target`` found as a resume finds it,
    :func:`glassloop.config.assemble.located`), a positive input shape and class count."""
    spec = _json_field(weights.metadata, "glassloop.model", weights.path)
    if spec is None:
        raise CheckpointError(
            f"checkpoint: '{weights.path}' has no glassloop model description; build the model "
            "in code and call glassloop.load_weights(model, path)"
        )
    try:
        model = from_dict({"model": spec["model"]}).model
        # (a file model.target found from here or from the folder the run was started in)
        model = located(Config(model=model), recorded_folder(weights.path)).model
        input_shape = [_positive(d) for d in spec["input_shape"]]
        num_classes = _positive(spec["num_classes"])
        for key in ("vocab_size", "pad_id"):
            value = spec.get(key, 0)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} = {value!r}")
        task = spec.get("task", "classification")  # files written before tasks existed
        if task not in TASKS:
            raise ValueError(f"task = {task!r}")
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint: '{weights.path}' has a malformed model description ({err})"
        ) from err
    return {
        **spec,
        "model": model,
        "input_shape": input_shape,
        "num_classes": num_classes,
        "task": task,
    }


def _positive(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def load_model(
    path: str | Path, *, model_class: ModelClass | None = None, trust_code: bool = False
) -> nn.Module:
    """Rebuild the model described in a glassloop weights file (or run directory, or
    checkpoint) and load its weights, in eval mode. No pickle, and no code named in the file:
    a model of your own comes from ``model_class`` (called with the file's ``model.kwargs``),
    or is imported from the file's ``model.target`` only with ``trust_code=True``.

    Example::

        model = glassloop.load_model("runs/demo/model.safetensors")
        probs = glassloop.predict(model, images)
        mine = glassloop.load_model("runs/mine/model.safetensors", model_class=MyNet)
    """
    weights = read_weights(path)
    return model_from(weights, model_description(weights), model_class, trust_code)


def model_from(
    weights: Weights, spec: dict[str, Any], model_class: ModelClass | None, trust_code: bool
) -> nn.Module:
    """The model of ``spec`` with ``weights`` loaded (see :func:`load_model`)."""
    cfg: ModelConfig = spec["model"]
    if model_class is not None:
        try:
            shape, outputs = tuple(spec["input_shape"]), int(spec["num_classes"])
            model = model_class(**data_kwargs(model_class, cfg.kwargs, shape, outputs))
        except Exception as err:  # the user's constructor may raise anything
            raise ModelError(f"model: {model_class!r}(**{cfg.kwargs}) failed: {err}") from err
    else:
        require_trust({"model": {"target": cfg.target}}, weights.path, trust_code)
        check_on_meta(cfg, spec, weights)
        model = build_model(cfg, **build_arguments(spec))
    load_onto(model, weights.tensors, weights.path, weights.base)
    # What glassloop.predict(model, x) returns follows the task the weights were trained for.
    setattr(model, TASK_ATTRIBUTE, spec["task"])
    return model.eval()


def build_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """What :func:`glassloop.config.models.build_model` takes besides the model section, from a
    weights file's description (:func:`model_description`)."""
    return {
        "input_shape": tuple(spec["input_shape"]),
        "num_classes": spec["num_classes"],
        "vocab_size": int(spec.get("vocab_size", 0)),
        "pad_id": int(spec.get("pad_id", 0)),
        "target_scale": target_scale_of(spec.get("preprocessing") or {}),
    }


def check_on_meta(cfg: ModelConfig, spec: dict[str, Any], weights: Weights) -> None:
    """A built-in model's shapes first, on the meta device (no memory): a model section that
    does not match the file's tensors (``hidden = [2**20, 2**20]`` in an edited config.json:
    4 TB) is refused before anything is allocated."""
    if not cfg.target:
        with torch.device("meta"):
            check_fits(build_model(cfg, **build_arguments(spec)), weights)


def check_fits(model: nn.Module, weights: Weights) -> None:
    """Every key present with the right shape and dtype, nothing left over."""
    stored = {k: (list(t.shape), safetensors_dtype(t.dtype)) for k, t in weights.tensors.items()}
    check_fit(model, stored, weights.path, recorded_names(weights.base))  # (the base: checked
    # against its digests when loaded)
