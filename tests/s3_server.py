"""A real S3 server on 127.0.0.1 for the tests (moto's server mode, as s3fs's own test suite
uses), reached over HTTP by the real client: no patching of the client. Started and stopped by
the test that needs it."""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Iterator

import pytest

SECRET = "glassloop-test-secret-7f3a"  # must never appear in anything glassloop writes


@contextlib.contextmanager
def local_s3(*buckets: str) -> Iterator[dict[str, str]]:
    """A server on a free port with ``buckets`` made, and the environment that points s3fs
    at it (set in this process, and returned for subprocesses): what a user's ``AWS_*``
    variables or profile do."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets per process, not per server: an earlier test's server in this
    # process (one xdist worker runs many files) left its own, and making ``bucket`` again
    # failed (FileExistsError). Each server starts empty.
    reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "glassloop-test-key",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            s3fs.S3FileSystem.clear_instance_cache()
            for bucket in buckets:
                s3fs.S3FileSystem().mkdir(bucket)
            yield {**os.environ, **env}
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.stop()
