"""What ran: glassloop/torch/python versions, platform, the git SHA of the working dir, and
the folder a run's relative paths (``data.path``, a file ``model.target``) are read from."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from glassloop.run_dir import layout
from glassloop.storage.redaction import redacted


@functools.lru_cache(maxsize=8)
def git_sha(cwd: Path | None = None) -> str | None:
    """The commit of the git repository around ``cwd`` (``None`` outside a repository)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def environment(deterministic: str | None = None) -> dict[str, Any]:
    """Versions and machine facts recorded with every run (and, when given, whether torch's
    deterministic algorithms were on: :func:`glassloop.rng.use_deterministic`).

    >>> sorted(environment())[:3]
    ['argv', 'cuda', 'cwd']
    """
    from glassloop._version import __version__

    return {
        "glassloop": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "git_sha": git_sha(),
        "argv": redacted(list(sys.argv)),  # (a URI's password on the command line: ***)
        "cwd": str(_PATHS_FROM.get() or Path.cwd().resolve()),
        **({"deterministic": deterministic} if deterministic is not None else {}),
    }


# Set by a resume from another folder: the folder its first start recorded, which its
# relative paths still name (the current one would send the next eval to the wrong place).
_PATHS_FROM: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "paths_from", default=None
)


@contextlib.contextmanager
def paths_from(folder: Path | None) -> Iterator[None]:
    """Record ``folder`` (not the current one) as the run's ``cwd`` while inside."""
    token = _PATHS_FROM.set(folder)
    try:
        yield
    finally:
        _PATHS_FROM.reset(token)


def recorded_folder(source: Path) -> Path | None:
    """The folder the run that wrote ``source`` (a run directory, one of its checkpoint
    directories, or a weights file in one) was started in: ``cwd`` of its ``run.json`` or
    of a checkpoint's ``meta.json``; ``None`` when nothing says (an exported file, a run
    written before glassloop recorded it).

    >>> recorded_folder(Path("no/such/run")) is None
    True
    """
    places = [source / layout.STATUS, source / layout.META, source.parent / layout.STATUS]
    places.append(source.parent.parent / layout.STATUS)  # RUN/checkpoints/step-N
    for place in places:
        try:
            info = json.loads(place.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        if isinstance(info, dict) and isinstance(info.get("versions"), dict):
            info = info["versions"]  # a checkpoint's meta.json
        folder = info.get("cwd") if isinstance(info, dict) else None
        if isinstance(folder, str) and folder:
            return Path(folder)
    return None
