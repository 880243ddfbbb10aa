"""Shared fixtures. The MNIST cache goes to one temporary folder for the whole session."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster on 127.0.0.1 (2 CPUs) for one test module; its address (for
    ``RAY_ADDRESS``). What Ray changes in this process (its imports and ``ray.init`` set
    environment variables and a SIGTERM handler, and keep them after ``ray.shutdown()``) is
    put back, for the tests this worker runs next."""
    environment, sigterm = dict(os.environ), signal.getsignal(signal.SIGTERM)
    import ray

    # Ray's controller takes a report every 2 s by default (a worker's next report waits for
    # it): the tests' runs report every few steps.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.05"
    context = ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        signal.signal(signal.SIGTERM, sigterm)
