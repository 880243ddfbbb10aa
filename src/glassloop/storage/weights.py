"""The weights format: safetensors files of a model's state dict, pickle-free.

Written atomically with the metadata in sorted order (the same tensors and metadata give
the same bytes); read only after the header was checked (:func:`read_safetensors_header`)
and every key, shape and dtype was found to fit the model (:func:`check_fit`), so a file
that does not fit fails before anything large is allocated. Checkpoints
(:mod:`glassloop.run_dir.checkpoints`) store their weights this way too.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from glassloop.distributed.world import unwrap_model
from glassloop.errors import CheckpointError
from glassloop.storage.atomic import atomic_path
from glassloop.storage.frozen_base import METADATA_KEY as BASE_KEY
from glassloop.storage.frozen_base import FrozenBase
from glassloop.storage.hashed_files import write_safetensors

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit for the JSON header


def weights_dict(
    model: nn.Module | dict[str, torch.Tensor],
    to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every key of the unwrapped state dict (or of a dict of tensors) as its own dense CPU
    tensor (tied weights are stored once per name, so every key is present and checkable
    on load; ``to_host``: how a tensor gets to the CPU, e.g. a private copy)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    tensors = model if isinstance(model, dict) else unwrap_model(model).state_dict()
    for key, tensor in tensors.items():
        tensor = to_host(tensor) if to_host is not None else tensor.detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if ptr in storages or not tensor.is_contiguous():
            tensor = tensor.clone().contiguous()
        storages.add(ptr)
        out[key] = tensor
    return out


def save_weights(
    model: nn.Module | dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Save the model's weights (unwrapped; or a dict of tensors) to a safetensors file,
    atomically."""
    with atomic_path(Path(path)) as tmp:
        write_safetensors(weights_dict(model), tmp, metadata)
        tmp.chmod(0o644)  # safetensors creates 0600; weights are meant to be shared


def read_safetensors(
    path: Path, header: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a safetensors file, its header checked first (one
    read of it: :func:`read_safetensors_header`; ``header``: read and checked already)."""
    header = header if header is not None else read_safetensors_header(path)
    return _load_checked(path), dict(header.get("__metadata__") or {})


def _load_checked(path: Path) -> dict[str, torch.Tensor]:
    """``load_file`` of a file whose header was checked; anything safetensors itself still
    refuses becomes a :class:`CheckpointError`."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint: cannot read '{path}': {err}") from err


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Each tensor's ``shape`` and ``dtype`` and the ``__metadata__`` of a safetensors file,
    checked without reading any tensor data: ``safetensors.safe_open`` refuses (since 0.8)
    a header that is not a JSON object, metadata that is not a table of strings, unknown
    dtypes, shapes that are not lists of non-negative integers or overflow, and byte ranges
    that do not match their shape, overlap, leave gaps or leave bytes over at the end. A
    pickle (``torch.save``) file fails here: its first bytes are no header. The header's
    length is read first, so a file that claims more than it has is named as such."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
    except OSError as err:
        raise CheckpointError(f"checkpoint: cannot read '{path}': {err.strerror}") from err
    if len(prefix) < 8:
        raise CheckpointError(
            f"checkpoint: '{path}' is not a safetensors file ({size} bytes: truncated or empty)"
        )
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"checkpoint: '{path}' is not a valid safetensors file (header claims {length} "
            f"bytes, file has {size}); truncated, corrupt or not safetensors"
        )
    try:
        with safe_open(str(path), framework="pt") as opened:
            header: dict[str, Any] = {"__metadata__": opened.metadata()}
            for key in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = opened.get_slice(key)
                header[key] = {"shape": tensor.get_shape(), "dtype": tensor.get_dtype()}
    except (SafetensorError, OSError, ValueError) as err:
        reason = str(err).removeprefix("Error while deserializing header: ")
        if "not fully covered" in reason:  # (safetensors' words for it)
            reason = "a tensor points outside the file, or bytes are left over"
        raise CheckpointError(
            f"checkpoint: '{path}' is not a valid safetensors file ({reason}; truncated, "
            "corrupt or crafted)"
        ) from err
    return header


def header_shapes(header: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    """Each tensor's shape and dtype, from a checked header."""
    return {k: (list(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def check_fit(
    model: nn.Module,
    stored: dict[str, tuple[list[int], str]],
    source: Path,
    base: set[str] | frozenset[str] = frozenset(),
) -> None:
    """``stored`` maps each key to its shape and safetensors dtype; raise one
    :class:`CheckpointError` listing every key that does not fit ``model`` (``base``: keys the
    model's own frozen base supplies, :mod:`glassloop.storage.frozen_base`)."""
    expected = unwrap_model(model).state_dict()
    problems: list[str] = []
    missing = sorted(set(expected) - set(stored) - set(base))
    unexpected = sorted(set(stored) - set(expected))
    if missing:
        problems.append(f"missing keys {few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {few(unexpected)}")
    for key in sorted(set(expected) & set(stored)):
        want = expected[key]
        shape, dtype = stored[key]
        if list(want.shape) != shape:
            problems.append(f"'{key}' has shape {shape}, the model expects {list(want.shape)}")
        if dtype != safetensors_dtype(want.dtype):
            problems.append(
                f"'{key}' is {dtype}, the model expects {safetensors_dtype(want.dtype)}"
            )
    if problems:
        cut = 2 * FEW  # (each names one key: a shape or a dtype)
        shown = problems[:cut] + ([f"{len(problems) - cut:,} more"] if len(problems) > cut else [])
        raise CheckpointError(f"checkpoint: '{source}' does not fit the model: " + "; ".join(shown))


FEW = 5  # names an error line quotes before it counts the rest (a file may hold 300,000)


def few(names: list[str]) -> str:
    """``names`` as an error line quotes them: the first few, then how many more.

    >>> few(["a", "b"]), few([f"k{i}" for i in range(300_000)])
    ("['a', 'b']", "['k0', 'k1', 'k2', 'k3', 'k4'] and 299,995 more")
    """
    if len(names) <= FEW:
        return str(names)
    return f"{names[:FEW]} and {len(names) - FEW:,} more"


def load_checked(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    source: Path,
    base: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Load tensors already in memory into ``model`` (unwrapped) after :func:`check_fit`
    (``base``: the keys its frozen base supplies, already checked, left as they are)."""
    shapes = {k: (list(t.shape), safetensors_dtype(t.dtype)) for k, t in tensors.items()}
    check_fit(model, shapes, source, base)
    unwrap_model(model).load_state_dict(tensors, strict=not base)


def load_onto(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: Path, base: Any = None
) -> None:
    """:func:`load_checked`, ``model``'s own frozen base supplying the tensors a fine-tuned
    run's weights leave out (``base``: their record, :mod:`glassloop.storage.frozen_base`), refused
    in one line unless it is the base they were trained on."""
    supplied = FrozenBase.check(model, base, set(tensors), source) if base else set()
    load_checked(model, tensors, source, supplied)


def safetensors_dtype(dtype: torch.dtype) -> str:
    names = {
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float64: "F64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    return names.get(dtype, str(dtype))


def load_weights(model: nn.Module, path: Path) -> dict[str, str]:
    """Load a safetensors file into ``model`` after checking that every key, shape and
    dtype fits; return the file's metadata."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint: file '{path}' not found")
    if path.suffix != ".safetensors":
        raise CheckpointError(
            f"checkpoint: '{path}' is not a .safetensors file; glassloop never unpickles "
            "(.pt/.pth/.ckpt); convert it with safetensors.torch.save_file"
        )
    header = read_safetensors_header(path)
    metadata, stored = dict(header.get("__metadata__") or {}), header_shapes(header)
    # An adapter's weights (a fine-tuned run's final ones): the rest is the model's own
    # base, refused unless it is the one they were trained on (glassloop.storage.frozen_base).
    record = metadata.get(BASE_KEY)
    base = FrozenBase.check(model, record, set(stored), path) if record else set()
    check_fit(model, stored, path, base)  # before anything is allocated
    unwrap_model(model).load_state_dict(_load_checked(path), strict=not base)
    return metadata


def weights_metadata(model_spec: Any) -> dict[str, str]:
    """The safetensors metadata of a weights file: its format and, when the model was built
    from a config, how to rebuild it (``glassloop.model``, keys sorted)."""
    metadata = {"format": "glassloop-weights"}
    if model_spec is not None:
        metadata["glassloop.model"] = json.dumps(model_spec, sort_keys=True)
    return metadata


def weights_finite(model: nn.Module | dict[str, torch.Tensor]) -> bool:
    """Whether every floating-point weight and buffer of ``model`` (or of a dict of tensors)
    is finite."""
    tensors = model if isinstance(model, dict) else unwrap_model(model).state_dict()
    return all(all_finite(t) for t in tensors.values())


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite. A sum first (any NaN or inf makes it
    non-finite; 20x faster than ``isfinite().all()``, which allocates a mask as large as the
    tensor): only a non-finite sum, which finite values can also give by overflowing, is
    checked element by element."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or not tensor.numel():
        return True
    return bool(tensor.sum().isfinite().all()) or bool(tensor.isfinite().all())
