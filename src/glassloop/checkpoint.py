"""Atomic, pickle-free, verified checkpoints; keep-last pruning; the best checkpoint.

Layout of a run directory::

    RUN_DIR/checkpoints/step-00000120/   model.safetensors   weights (no module./_orig_mod.)
                                         state.safetensors   every other tensor of the state
                                         state.json          the rest (structure, numbers)
                                         meta.json           format, step, epoch, metrics,
                                                             config, versions, git SHA
                                         manifest.json       size + SHA-256 of each file,
                                                             written last
    RUN_DIR/checkpoints/latest           name of the newest committed checkpoint
    RUN_DIR/best/                        a copy of the best checkpoint (checkpoint.monitor)

A checkpoint is written into ``checkpoints/.tmp-...`` (same filesystem), each file fsync'd,
then renamed into place and the parent fsync'd; only then does ``latest`` move (the same way).
A crash at any moment leaves the previous checkpoint and pointer intact; leftovers are removed
at the next start. Nothing here ever unpickles: weights and state tensors are safetensors
(headers checked before anything is allocated), everything else is JSON.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from glassloop.errors import GlassloopError
from glassloop.serialization import UnserializableError, flatten, unflatten

FORMAT_VERSION = 1
CREATOR = "glassloop"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
STEP_DIR = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "state.safetensors", "state.json", "meta.json")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit for the JSON header
MAX_JSON_BYTES = 256 * 1024 * 1024
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class CheckpointError(GlassloopError):
    """A checkpoint that cannot be read, does not fit, or cannot be written."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, quota, permissions); earlier ones are intact."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``)
    wrappers, so saved keys carry no ``module.`` / ``_orig_mod.`` prefixes."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


# ------------------------------------------------------------------------ durable file writes
def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success fsync it and rename it into
    place, so a reader sees the old file or the new one, never half of one.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> with atomic_path(d / "x.txt") as tmp: _ = tmp.write_text("hi")
    >>> (d / "x.txt").read_text()
    'hi'
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (floats round-trip exactly: Python writes their shortest repr)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return repr(value)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- weights files
def weights_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every key of the unwrapped state dict as its own dense CPU tensor (tied weights are
    stored once per name, so every key is present and checkable on load)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, tensor in unwrap_model(model).state_dict().items():
        tensor = tensor.detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if ptr in storages or not tensor.is_contiguous():
            tensor = tensor.clone().contiguous()
        storages.add(ptr)
        out[key] = tensor
    return out


def save_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save the model's weights (unwrapped) to a safetensors file, atomically."""
    with atomic_path(Path(path)) as tmp:
        write_safetensors(weights_dict(model), tmp, metadata)
        tmp.chmod(0o644)  # safetensors creates 0600; weights are meant to be shared


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None
) -> None:
    """``safetensors.torch.save_file``, with its I/O failures (disk full, quota) raised as the
    ``OSError`` they are, so callers handle every write failure in one place."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and check a safetensors header without allocating anything large.

    Refuses a header longer than the file or than 100 MiB, a header that is not a JSON
    object, unknown dtypes, and tensors whose byte ranges leave the file or do not match
    their shape. A pickle (``torch.save``) file fails here: its first bytes are no header.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"checkpoint: '{path}' is not a safetensors file ({size} bytes: truncated "
                    "or empty)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"checkpoint: '{path}' is not a valid safetensors file (header claims "
                    f"{length} bytes, file has {size}); truncated, corrupt or not safetensors"
                )
            raw = handle.read(length)
    except OSError as err:
        raise CheckpointError(f"checkpoint: cannot read '{path}': {err.strerror}") from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint: '{path}' is not a valid safetensors file (header is not JSON)"
        ) from err
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint: '{path}' has a malformed safetensors header")
    data_size = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = SAFETENSORS_DTYPES[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            numel = math.prod(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint: '{path}' has a malformed entry for tensor '{name}'"
            ) from err
        if not 0 <= start <= end <= data_size or end - start != numel * itemsize:
            raise CheckpointError(
                f"checkpoint: '{path}' tensor '{name}' points outside the file or does not "
                "match its shape (truncated or corrupt)"
            )
    return header


def check_weights_fit(model: nn.Module, path: Path) -> None:
    """List every missing, unexpected, shape- or dtype-mismatched key (torch would cast
    dtypes silently; we refuse)."""
    header = read_safetensors_header(path)
    expected = unwrap_model(model).state_dict()
    stored = {k: v for k, v in header.items() if k != "__metadata__"}
    problems: list[str] = []
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for key in sorted(set(expected) & set(stored)):
        want = expected[key]
        shape = [int(d) for d in stored[key]["shape"]]
        if list(want.shape) != shape:
            problems.append(f"'{key}' has shape {shape}, the model expects {list(want.shape)}")
        dtype = _safetensors_dtype(want.dtype)
        if stored[key]["dtype"] != dtype:
            problems.append(f"'{key}' is {stored[key]['dtype']}, the model expects {dtype}")
    if problems:
        raise CheckpointError(
            f"checkpoint: '{path}' does not fit the model: " + "; ".join(problems)
        )


def _safetensors_dtype(dtype: torch.dtype) -> str:
    names = {
        torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }  # fmt: skip
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
    check_weights_fit(model, path)
    tensors = load_file(str(path))
    unwrap_model(model).load_state_dict(tensors, strict=True)
    with safe_open(str(path), "pt") as handle:
        return dict(handle.metadata() or {})


# ------------------------------------------------------------------------------ checkpoints
@dataclass
class Checkpoint:
    """A verified checkpoint read from disk."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Our committed checkpoint directories, oldest first (foreign folders are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and _ours(p)]
    return sorted(found, key=lambda p: p.name)


def _ours(path: Path) -> bool:
    """A directory glassloop committed: its manifest says so."""
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("creator") == CREATOR


def latest_pointer(run_dir: Path) -> Path | None:
    pointer = checkpoints_dir(run_dir) / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return checkpoints_dir(run_dir) / name if STEP_DIR.match(name) else None


def clean_temporaries(run_dir: Path) -> list[Path]:
    """Remove what an interrupted write left behind; return what was removed."""
    removed: list[Path] = []
    for root in (checkpoints_dir(run_dir), Path(run_dir)):
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if not path.is_dir():
                continue
            if path.name.startswith(TMP_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            elif path.name.startswith(OLD_PREFIX):
                original = root / path.name[len(OLD_PREFIX) :].rsplit("-", 1)[0]
                if original.exists():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.replace(path, original)  # a replace was cut between its renames: undo
                removed.append(path)
    return removed


def all_finite(model: nn.Module) -> bool:
    tensors = [t for t in unwrap_model(model).state_dict().values() if t.is_floating_point()]
    if not tensors:
        return True
    return bool(torch.stack([t.isfinite().all() for t in tensors]).all())


def write_checkpoint_dir(
    target: Path, model: nn.Module, state: dict[str, Any], meta: dict[str, Any]
) -> None:
    """Write a complete checkpoint into ``target`` atomically (see the module docstring)."""
    tree, tensors = flatten(state)
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        metadata = {"format": "glassloop-weights"}
        if meta.get("model_spec") is not None:
            metadata["glassloop.model"] = json.dumps(meta["model_spec"])
        write_safetensors(weights_dict(model), tmp / "model.safetensors", metadata)
        write_safetensors(tensors, tmp / "state.safetensors", None)
        (tmp / "state.json").write_text(json.dumps(tree), encoding="utf-8")
        (tmp / "meta.json").write_text(
            json.dumps(meta, indent=1, default=_jsonable) + "\n", encoding="utf-8"
        )
        files = {}
        for name in FILES:
            fsync_file(tmp / name)
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)}
        manifest = {"creator": CREATOR, "format": FORMAT_VERSION, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        fsync_file(tmp / "manifest.json")
        fsync_dir(tmp)
        if target.exists():  # replacing: swap with two renames (undone at start if cut)
            old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(
    run_dir: Path, model: nn.Module, state: dict[str, Any], meta: dict[str, Any]
) -> Path:
    """Commit ``checkpoints/step-<step>/`` and move ``latest`` to it; return its path.

    A checkpoint of the same step is replaced: the state after an epoch's end (evaluation,
    scheduler step, history) differs from the state after its last batch.

    Refuses non-finite weights; a failed write removes its temporary directory, keeps every
    earlier checkpoint and raises :class:`CheckpointWriteError` naming the last good one.
    """
    root = checkpoints_dir(run_dir)
    target = root / step_dir_name(int(meta["step"]))
    last = latest_pointer(run_dir)
    last_text = str(last) if last is not None else "none"
    if not all_finite(model):
        raise CheckpointError(
            f"checkpoint: the weights at step {meta['step']} are not finite (NaN/inf); not "
            f"saving them over good checkpoints. Last good checkpoint: {last_text}"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_checkpoint_dir(target, model, state, meta)
        with atomic_path(root / LATEST) as tmp:
            tmp.write_text(target.name + "\n", encoding="utf-8")
    except UnserializableError as err:
        raise CheckpointError(f"checkpoint: {err}") from err
    except OSError as err:
        code = errno.errorcode.get(err.errno or 0, "OSError")
        raise CheckpointWriteError(
            f"checkpoint: could not write '{target}': {err.strerror or err} ({code}); "
            f"nothing was lost, last good checkpoint: {last_text}"
        ) from err
    return target


def save_best(run_dir: Path, model: nn.Module, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write (or replace) ``RUN_DIR/best/`` with a full checkpoint, atomically."""
    target = Path(run_dir) / BEST
    try:
        write_checkpoint_dir(target, model, state, meta)
    except OSError as err:
        raise CheckpointWriteError(
            f"checkpoint: could not write '{target}': {err.strerror or err}; the previous "
            "best checkpoint is intact"
        ) from err
    return target


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` of our checkpoints; never the one ``latest``
    names, never a folder glassloop did not create."""
    if keep_last < 1:
        return []
    ours = list_checkpoints(run_dir)
    keep = set(ours[-keep_last:])
    latest = latest_pointer(run_dir)
    removed = []
    for path in ours:
        if path not in keep and path != latest:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def read_checkpoint(path: Path) -> Checkpoint:
    """Verify every file against the manifest (size, SHA-256), then read it. Any problem is
    one :class:`CheckpointError` naming the path and the reason."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: '{path}' is not a checkpoint directory")
    manifest = _read_json(path / "manifest.json", path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != FORMAT_VERSION or not isinstance(files, dict):
        raise CheckpointError(f"checkpoint: '{path}' has an unknown manifest format")
    for name in FILES:
        entry = files.get(name)
        file = path / name
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint: '{path}': {name} is not in the manifest")
        if not file.is_file():
            raise CheckpointError(f"checkpoint: '{path}': {name} is missing")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"checkpoint: '{path}': {name} has {size} bytes, the manifest says "
                f"{entry.get('size')} (truncated or replaced)"
            )
        if sha256_of(file) != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint: '{path}': {name} fails its SHA-256 check (corrupt or modified)"
            )
    meta = _read_json(path / "meta.json", path)
    tree = _read_json(path / "state.json", path)
    read_safetensors_header(path / "model.safetensors")
    read_safetensors_header(path / "state.safetensors")
    try:
        tensors = load_file(str(path / "state.safetensors"))
        state = unflatten(tree, tensors)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint: '{path}': the training state is malformed") from err
    if not isinstance(meta, dict) or not isinstance(state, dict) or "step" not in meta:
        raise CheckpointError(f"checkpoint: '{path}': meta.json or state.json is malformed")
    return Checkpoint(path, meta, state)


def _read_json(file: Path, checkpoint: Path) -> Any:
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"checkpoint: '{checkpoint}': {file.name} is too large")
        return json.loads(file.read_bytes())
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint: '{checkpoint}': {file.name} is missing") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint: '{checkpoint}': {file.name} is not valid JSON (corrupt or not a "
            "glassloop file)"
        ) from err
    except OSError as err:
        raise CheckpointError(f"checkpoint: cannot read '{file}': {err.strerror}") from err


def find_resumable(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and a warning for each newer one that did not."""
    warnings: list[str] = []
    # Newest first. A committed directory is complete (renamed into place only after its
    # manifest was written), so one newer than `latest` (a crash between the rename and the
    # pointer move) is as good as the one `latest` names.
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return read_checkpoint(path), warnings
        except CheckpointError as err:
            warnings.append(f"{err}; falling back to the previous checkpoint")
    return None, warnings
