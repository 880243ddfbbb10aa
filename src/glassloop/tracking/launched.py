"""The moment this process first imported glassloop: a command's launch, give or take the
interpreter's own start (what the end summary and run.json call "since launch")."""

from __future__ import annotations

import time

LAUNCHED = time.perf_counter()


def since_launch() -> float:
    """Seconds since glassloop was first imported in this process (a command's imports, data
    loading and start-up included)."""
    return time.perf_counter() - LAUNCHED
