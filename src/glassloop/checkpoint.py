"""Writing and reading model weights as safetensors (pickle-free), atomically."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import load_model, save_model
from torch import nn

from glassloop.errors import GlassloopError


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``)
    wrappers, so saved keys carry no ``module.`` / ``_orig_mod.`` prefixes."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
        with tmp.open("rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def save_weights(model: nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save the model's weights (unwrapped) to a safetensors file, atomically."""
    with atomic_path(Path(path)) as tmp:
        save_model(unwrap_model(model), str(tmp), metadata=metadata)
        tmp.chmod(0o644)  # safetensors creates 0600; weights are meant to be shared


def load_weights(model: nn.Module, path: Path) -> None:
    """Load a safetensors file into ``model``; every missing or unexpected key is an error."""
    path = Path(path)
    if not path.is_file():
        raise GlassloopError(f"weights: file '{path}' not found")
    try:
        load_model(unwrap_model(model), str(path), strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise GlassloopError(f"weights: '{path}' does not fit the model: {detail}") from err
