"""Pickle-free storage of nested training state: tensors to safetensors, the rest to JSON.

``flatten(obj)`` walks dicts, lists, tuples, tensors, numpy arrays and scalars and returns a
JSON-able tree in which every tensor is replaced by ``{"__tensor__": "t000001"}``, plus the
dict of those tensors. ``unflatten`` reverses it. Anything else (a lambda, an arbitrary
object) is refused: a checkpoint that needed pickle to load would be a security hole.

Why not ``torch.save``/``torch.load``: loading a pickle runs code, ``weights_only=True`` has had
bypasses and is switched off by ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``. JSON and safetensors
carry data only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassloop.storage.atomic import atomic_path

MARKERS = ("__tensor__", "__tuple__", "__pairs__", "__ndarray__", "__float__")


class UnserializableError(TypeError):
    """A value that cannot be stored without pickle."""


def flatten(
    obj: Any, to_host: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-able tree and a dict of named tensors (each a dense CPU
    tensor; ``to_host``: how one gets there, e.g. a private copy for a background save).

    >>> tree, tensors = flatten({"step": 3, "w": torch.ones(2), "betas": (0.9, 0.99)})
    >>> tree
    {'step': 3, 'w': {'__tensor__': 't000000'}, 'betas': {'__tuple__': [0.9, 0.99]}}
    >>> back = unflatten(tree, tensors)
    >>> back["betas"], back["w"].tolist()
    ((0.9, 0.99), [1.0, 1.0])
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return {"__float__": repr(value)}  # "nan", "inf", "-inf": strict JSON has none
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            key = seen.get(id(value))
            if key is None:
                key = f"t{len(tensors):06d}"
                # contiguous CPU copies: safetensors stores dense row-major buffers only
                host = to_host(value) if to_host is not None else value.detach().to("cpu")
                tensors[key] = host.contiguous()
                seen[id(value)] = key
            return {"__tensor__": key}
        if isinstance(value, np.ndarray):
            return {"__ndarray__": {"dtype": str(value.dtype), "data": value.tolist()}}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            plain = all(isinstance(k, str) for k in value) and not any(k in MARKERS for k in value)
            if plain:
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            return {
                "__pairs__": [
                    [walk(k, f"{path}<key>"), walk(v, f"{path}[{k!r}]")] for k, v in value.items()
                ]
            }
        raise UnserializableError(
            f"cannot store {path or 'value'} of type {type(value).__name__} without pickle "
            "(allowed: tensors, numbers, strings, lists, tuples, dicts, numpy arrays)"
        )

    return walk(obj, ""), tensors


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild what :func:`flatten` split; a missing tensor key raises ``KeyError``."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if len(tree) == 1:
            ((marker, payload),) = tree.items()
            if marker == "__tensor__":
                return tensors[payload]
            if marker == "__tuple__":
                return tuple(unflatten(v, tensors) for v in payload)
            if marker == "__pairs__":
                return {_hashable(unflatten(k, tensors)): unflatten(v, tensors) for k, v in payload}
            if marker == "__float__" and payload in ("nan", "inf", "-inf"):
                return float(payload)
            if marker == "__ndarray__":
                return np.asarray(payload["data"], dtype=np.dtype(payload["dtype"]))
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    return tree


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def stable_repr(value: Any) -> str:
    """``repr`` without memory addresses, to describe a value in a config that is compared
    across processes: a function is its qualified name, and ``<... at 0x7f..>`` loses the
    address (it differs in every process, so a resume would always see a "change").

    >>> import torch.nn.functional as F
    >>> stable_repr(F.cross_entropy), stable_repr(lambda x: x)
    ('torch.nn.functional.cross_entropy', 'glassloop.storage.serialization.<lambda>')
    """
    if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type):
        module = getattr(value, "__module__", None) or "?"
        return f"{module}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def behaviour_digest(value: Any) -> str | None:
    """8 hex digits of SHA-256 over what decides what ``value`` (a loss) computes beyond its
    name, so that a resume tells a function edited between runs from the same one: a
    function's source (its bytecode where no source is found) and defaults; a module's own
    settings (plain attributes and buffers) and, for a class of the user's, its source.
    ``None`` for torch's own functions: their name says it all (and their source changes
    with torch's version, which must not block a resume).

    >>> import torch.nn.functional as F
    >>> behaviour_digest(F.cross_entropy) is None, len(behaviour_digest(lambda a, b: a - b))
    (True, 8)
    """
    parts: list[bytes] = []
    if isinstance(value, torch.nn.Module):
        settings = {
            k: v
            for k, v in sorted(vars(value).items())
            if not k.startswith("_")
            and k != "training"
            and isinstance(v, (int, float, str, bool, type(None)))
        }
        parts.append(repr(settings).encode())
        for name, buffer in value.named_buffers():
            tensor = buffer.detach().cpu().contiguous()
            parts.append(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            parts.append(tensor.view(-1).view(torch.uint8).numpy().tobytes())
        cls = type(value)
        if not cls.__module__.startswith("torch."):
            parts.append(_source(cls))
    elif callable(value) and hasattr(value, "__code__"):
        if getattr(value, "__module__", "").startswith("torch."):
            return None
        parts.append(_source(value))
        parts.append(stable_repr(getattr(value, "__defaults__", None)).encode())
        parts.append(stable_repr(getattr(value, "__kwdefaults__", None)).encode())
    else:
        return None
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:8]


def _source(value: Any) -> bytes:
    """The source of a function or class; a function's bytecode and constants where the
    source cannot be read (defined in a REPL or an exec'd string)."""
    import inspect

    try:
        return inspect.getsource(value).encode()
    except (OSError, TypeError):
        code = getattr(value, "__code__", None)
        if code is None:
            return stable_repr(value).encode()
        return bytes(code.co_code) + stable_repr(code.co_consts).encode()


def dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict flattened to ``{"section.key": value}`` (empty dicts kept as values).

    >>> dotted({"optim": {"lr": 0.1, "kwargs": {}}, "seed": 0})
    {'optim.lr': 0.1, 'optim.kwargs': {}, 'seed': 0}
    """
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(dotted(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def finite_json(value: Any) -> Any:
    """``value`` with NaN/inf floats as ``None``: glassloop's JSON files are strict JSON (a
    reader that meets ``NaN`` or ``Infinity`` in them refuses the file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (floats round-trip exactly: Python writes their shortest repr)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, default=stable_repr) + "\n", encoding="utf-8")


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, read a MiB at a time (a checkpoint's manifest)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
