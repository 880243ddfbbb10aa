"""Hugging Face layout: a folder that ``transformers`` loads with
``AutoModelFor....from_pretrained(folder)`` (config.json + model.safetensors, sharded above a
size with model.safetensors.index.json) or, for a peft adapter, one that
``PeftModel.from_pretrained(base, folder)`` loads (adapter_config.json +
adapter_model.safetensors).

Two ways in:

* from the trained model, in Python (:func:`export_hf`): the library's own ``save_pretrained``
  (tied weights, shards, generation config as transformers writes them), the adapter merged
  into its base on request (``merged=True``, on a copy: the model trained on is unchanged);
* from a run directory (:func:`glassloop.tools.export.export_run_hf`, ``glassloop export RUN
  --format hf``, through :func:`write_run_hf`): a run of
  a transformers or peft model records its configuration in its final weights' metadata
  (:func:`describe`), and the folder is written from the files alone, without importing either
  library. The layout is two JSON files and safetensors; its sharding is the index file's
  ``weight_map`` (a greedy split in the model's order, as transformers' own splitter does):
  written here rather than adding ``huggingface_hub`` to glassloop's dependencies.

Either way pickle-free (anything but JSON, safetensors and a model card in the written folder
is refused, before it is committed) and nothing outside the folder is touched: everything is
written into a fresh staging folder beside it, then renamed into place; an existing folder
(or a link) of that name is left alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.distributed.world import unwrap_model
from glassloop.errors import CheckpointError
from glassloop.storage.atomic import ForeignPathError, remove_tree
from glassloop.storage.frozen_base import METADATA_KEY as BASE_KEY
from glassloop.storage.frozen_base import library_of
from glassloop.storage.hashed_files import write_safetensors
from glassloop.storage.weights import weights_dict

HF_CONFIG = "glassloop.hf_config"  # a weights file's metadata: the transformers config
PEFT_CONFIG = "glassloop.peft_config"  # the adapter's config (adapter_config.json)
PEFT_KEYS = "glassloop.peft_keys"  # each adapter tensor's name in peft's files
ALLOWED = (".json", ".safetensors", ".md")  # what an exported folder may hold
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size, "5GB"


def describe(model: nn.Module, stored: set[str]) -> dict[str, str]:
    """What a run's final weights record of a transformers or peft model so that
    :func:`export_run_hf` can write its folder from the file alone (``stored``: the state-dict
    keys the file holds); ``{}`` for any other model."""
    model = unwrap_model(model)
    library = library_of(model)
    if library is None:
        return {}
    hf: Any = model  # (their attributes: config, peft_config, get_base_model)
    if library == "transformers":
        return {HF_CONFIG: hf.config.to_json_string(use_diff=False)}
    from peft import get_peft_model_state_dict  # (a peft model: peft is installed)

    name = hf.active_adapter
    # peft's names for the adapter's tensors, matched to ours by the memory they share
    theirs = {_where(t): key for key, t in get_peft_model_state_dict(model).items()}
    ours = model.state_dict()
    keys = {key: theirs[_where(t)] for key, t in ours.items() if _where(t) in theirs}
    config = hf.peft_config[name].to_dict()
    base = hf.get_base_model()
    return {
        HF_CONFIG: base.config.to_json_string(use_diff=False),
        PEFT_CONFIG: json.dumps(config, default=_listed, sort_keys=True),
        PEFT_KEYS: json.dumps({k: v for k, v in keys.items() if k in stored}, sort_keys=True),
    }


def _where(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Where a tensor's elements are: its storage, offset and shape."""
    offset = int(tensor.storage_offset())
    return tensor.untyped_storage().data_ptr(), offset, tuple(tensor.shape)


def _listed(value: Any) -> Any:
    """JSON for what a peft config holds besides JSON types (``target_modules``: a set)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def export_hf(model: nn.Module, folder: str | Path, *, merged: bool = False) -> Path:
    """Write ``model`` (a transformers model, or a peft model over one) into ``folder`` in
    Hugging Face layout with the library's own ``save_pretrained``: a peft model as its
    adapter (``PeftModel.from_pretrained(base, folder)``), or ``merged`` into its base (a
    transformers folder; merged on a copy). Return ``folder``.

    >>> export_hf(torch.nn.Linear(2, 2), "out")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    glassloop.errors.CheckpointError: export: a Linear is not a transformers or peft model; ...
    """
    model = unwrap_model(model)
    library = library_of(model)
    if library is None:
        raise CheckpointError(
            f"export: a {type(model).__name__} is not a transformers or peft model; "
            "glassloop.save_weights writes any model's weights"
        )
    if merged and library != "peft":
        raise CheckpointError("export: merged=True merges a peft adapter; this model has none")
    with _staged(Path(folder)) as staging:
        if merged:
            model = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
        model.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
    return Path(folder)


def write_run_hf(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    folder: Path,
    source: Path,
    *,
    merged: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a run's final weights (``tensors`` and their ``metadata``, read from
    ``source``) into ``folder`` in Hugging Face layout, from the configuration its training
    recorded (:func:`describe`); :func:`glassloop.tools.export.export_run_hf` reads them. A
    transformers model's weights go in shards of at most ``max_shard_bytes`` above that.
    ``merged``: refused (the run's files hold no base). Return ``folder``."""
    if source.is_dir():  # (a checkpoint: read_weights fell back to the newest)
        raise CheckpointError(
            f"export: '{source}' is a checkpoint, not the run's final weights (written when "
            "it finishes, with the model's Hugging Face config); resume the run to its end "
            "first, or call glassloop.export_hf(model, folder) on the model in Python"
        )
    if HF_CONFIG not in metadata:
        raise CheckpointError(
            f"export: '{source}' was not trained from a transformers or peft model (its "
            "weights record no Hugging Face config); export it with --format glassloop"
        )
    if merged:
        raise CheckpointError(
            f"export: '{source}' holds no base to merge an adapter into; merge in Python "
            "with glassloop.export_hf(model, folder, merged=True) on the trained model"
        )
    if PEFT_CONFIG in metadata:
        keys = _json(metadata.get(PEFT_KEYS, ""), source)
        adapter = {new: tensors[old] for old, new in keys.items() if old in tensors}
        if len(adapter) != len(keys):
            raise CheckpointError(f"export: '{source}' lacks tensors of its adapter")
        files = {"adapter_config.json": metadata[PEFT_CONFIG]}
        parts = {"adapter_model.safetensors": adapter}
    elif BASE_KEY in metadata:  # a transformers folder must hold every tensor
        raise CheckpointError(
            f"export: '{source}' holds the trained tensors without the frozen base "
            "(checkpoint.final_weights); transformers would fill the rest with random "
            "weights: call glassloop.export_hf(model, folder) on the model in Python, or "
            "train with checkpoint.final_weights = 'full'"
        )
    else:
        files = {"config.json": metadata[HF_CONFIG]}
        parts = _shards(tensors, max_shard_bytes)
        if len(parts) > 1:
            files["model.safetensors.index.json"] = _index(parts)
    with _staged(Path(folder)) as staging:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        for name, part in parts.items():
            write_safetensors(weights_dict(part), staging / name, {"format": "pt"})
    return Path(folder)


def _json(text: str, path: Path) -> dict[str, str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(f"export: '{path}': its record of the adapter's keys is malformed")
    return value


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> dict[str, dict[str, torch.Tensor]]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` of at most ``limit``
    bytes each (a tensor larger than that alone in one), in the model's order."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][key] = tensor
        size += nbytes
    if len(parts) == 1:
        return {"model.safetensors": parts[0]}
    n = len(parts)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": part for i, part in enumerate(parts, 1)}


def _index(shards: dict[str, dict[str, torch.Tensor]]) -> str:
    """model.safetensors.index.json: every tensor's shard, and their total size."""
    total = sum(t.numel() * t.element_size() for part in shards.values() for t in part.values())
    weight_map = {key: name for name, part in shards.items() for key in part}
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)


@contextlib.contextmanager
def _staged(folder: Path) -> Any:
    """A fresh folder beside ``folder`` to write into; renamed to ``folder`` once what was
    written is checked (JSON, safetensors and a model card only, plain files). An existing
    ``folder`` or a link of its name is refused and left as it is."""
    if os.path.lexists(folder):
        what = "is a symbolic link" if folder.is_symlink() else "already exists"
        raise ForeignPathError(
            f"export: '{folder}' {what}; glassloop left it untouched (it never writes into "
            "or through what is not its own): choose a new folder, or remove it first"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    # (a name short enough for any folder name's length; readable as save_pretrained's are)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name[:64]}.tmp-", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        for path in sorted(staging.iterdir()):
            if path.is_symlink() or not path.is_file() or path.suffix not in ALLOWED:
                raise CheckpointError(
                    f"export: the library wrote '{path.name}', which is not JSON or "
                    "safetensors; nothing was exported (glassloop never writes pickle files)"
                )
            path.chmod(0o644)
        os.rename(staging, folder)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_tree(staging)
        raise
