"""Shared fixtures. The MNIST cache goes to one temporary folder for the whole session."""

from __future__ import annotations

import os
import tempfile

# Set at import so that subprocesses started by tests inherit it too.
os.environ.setdefault("GLASSLOOP_CACHE_DIR", tempfile.mkdtemp(prefix="glassloop-cache-"))
# One thread per test process (and per process a test starts): `make test` runs two workers on
# two cores, and each worker's torch (and each training subprocess's) would otherwise take
# every core, its OpenMP threads spinning against the other worker's: a test alone took 42 s,
# beside the rest of the suite 129 s. Every number compared within a test comes from processes
# with the same setting; torch reads the variable when it is imported, after this file.
os.environ.setdefault("OMP_NUM_THREADS", "1")
