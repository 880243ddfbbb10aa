"""Where glassloop keeps what it can always rebuild: parsed datasets and local copies of runs
on object storage (:mod:`glassloop.run_dir.remote`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$GLASSLOOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/glassloop``, else ``~/.cache/glassloop``."""
    if env := os.environ.get("GLASSLOOP_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glassloop"
