"""What ran: glassloop/torch/python versions, platform, and the git SHA of the working dir."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from glassloop.redaction import redacted


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
    ['argv', 'cuda', 'git_sha']
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
        **({"deterministic": deterministic} if deterministic is not None else {}),
    }
