"""Shared fixtures. The MNIST cache goes to one temporary folder for the whole session."""

from __future__ import annotations

import os
import tempfile

import pytest
from _pytest.nodeid import NodeId

# Set at import so that subprocesses started by tests inherit it too.
os.environ.setdefault("GLASSLOOP_CACHE_DIR", tempfile.mkdtemp(prefix="glassloop-cache-"))
# One thread per test process (and per process a test starts): `make test` runs two workers on
# two cores, and each worker's torch (and each training subprocess's) would otherwise take
# every core, its OpenMP threads spinning against the other worker's: a test alone took 42 s,
# beside the rest of the suite 129 s. Every number compared within a test comes from processes
# with the same setting; torch reads the variable when it is imported, after this file.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` (make test): a file marked ``xdist_group`` goes whole to one worker.
    pytest-xdist 3.8 names a test's group by appending ``@group`` to its ``item._nodeid``,
    which pytest 9.2 no longer reads (its id is ``item._id``, a ``NodeId``; pytest-xdist issue
    1386): every group was spread over both workers, each building the module fixtures again
    (test_fsdp's two-process run, test_redaction's mlflow server) and one S3 server meeting
    another's bucket. The suffix is put where this pytest reads it, where it is missing."""
    if not getattr(config.option, "loadgroup", False):  # (set in an xdist worker)
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        )
        if names and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]
