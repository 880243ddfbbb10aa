"""Shared fixtures. The MNIST cache goes to one temporary folder for the whole session."""

from __future__ import annotations

import os
import tempfile

# Set at import so that subprocesses started by tests inherit it too.
os.environ.setdefault("GLASSLOOP_CACHE_DIR", tempfile.mkdtemp(prefix="glassloop-cache-"))
