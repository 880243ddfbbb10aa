"""Two nodes, one run on object storage: two torchrun "nodes" on 127.0.0.1 (c10d rendezvous,
each with a cache of its own as two machines' disks) train from Parquet shards in a bucket into
one ``s3://`` run on a real S3 server on 127.0.0.1. Node 1 is killed with SIGKILL mid-run (node 0 then fails at its next
collective), both are started again with ``--resume``, and the final weights and every epoch
row equal the uninterrupted two-node run's, bit for bit; the same two processes on one node
give the same weights. A SIGTERM to node 1 alone stops both nodes after the same step, with
one complete checkpoint of it in the bucket, and the resumed run ends bitwise the same."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import free_port
from s3_server import local_s3

pytestmark = pytest.mark.xdist_group("test_nodes_on_s3")

SMALL = [
    "--set", "data.name=parquet", "--set", "data.path=s3://nodes/data/", "--set", "data.batch_size=8",
    "--set", "data.shuffle_window=2", "--set", "model.hidden=[16]", "--set", "train.epochs=2",
    "--set", "checkpoint.every_n_steps=3", "--set", "train.progress=none",
    "--set", "train.dist_timeout_s=5",
]  # fmt: skip


# `glassloop train` whose rank 0 takes 7 s, longer than train.dist_timeout_s (5 s), alone at
# the start (SLOW=pull: a large checkpoint's pull) or the end (SLOW=end: its final uploads).
SLOW = """
import os, sys, threading
import glassloop.run_dir.remote as remote
from glassloop.cli.main import main

upload, pull = remote.RemoteRun._upload_run_files, remote.RemoteRun.pull
slow = os.environ["RANK"] == "0" and os.environ["SLOW"]

def upload_slowly(self, *, final=True):
    threading.Event().wait(7 if final and slow == "end" else 0)  # (its time, not a wait)
    return upload(self, final=final)

def pull_slowly(self, usable=None):
    threading.Event().wait(7 if slow == "pull" else 0)
    return pull(self, usable)

remote.RemoteRun._upload_run_files, remote.RemoteRun.pull = upload_slowly, pull_slowly
sys.exit(main(sys.argv[1:]))
"""


def nodes(
    tmp: Path,
    env: dict[str, str],
    url: str,
    *extra: str,
    kill_node_1: int = 0,
    term: int = 0,
    slow: str = "",
) -> list[int]:
    """Both nodes' torchrun, started together; their exit codes (node 0's, node 1's).
    ``kill_node_1``: node 1's process SIGKILLs itself after that step; ``term``: node 1's
    torchrun gets a SIGTERM (a scheduler's stop, on that node only) once that many step rows
    are in the logs; ``slow``: rank 0's pull or final uploads take longer than the processes'
    collective timeout (:data:`SLOW`)."""
    port, job = free_port(), f"job-{free_port()}"
    (tmp / "slow.py").write_text(SLOW)
    started = []
    sizes = [(tmp / f"node{node}.log").stat().st_size if (tmp / f"node{node}.log").exists() else 0
             for node in (0, 1)]  # fmt: skip
    for node in (0, 1):
        kill = ["--kill-at-step", str(kill_node_1)] if node == 1 and kill_node_1 else []
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", job,
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
            *(["slow.py"] if slow else ["-m", "glassloop"]),
            "train", *SMALL, "--run-dir", url, *extra, *kill,
        ]  # fmt: skip
        cache = {"GLASSLOOP_CACHE_DIR": str(tmp / f"node{node}-cache"), "SLOW": slow}
        log = open(tmp / f"node{node}.log", "ab")  # noqa: SIM115 (closed below)
        started.append((subprocess.Popen(command, cwd=tmp, env={**env, **cache}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True), log))  # fmt: skip
    if term:
        logs = [(tmp / f"node{node}.log", before) for node, before in enumerate(sizes)]
        while started[1][0].poll() is None:
            said = [path.read_bytes()[before:].count(b"loss:") for path, before in logs]
            if sum(said) >= term:
                started[1][0].send_signal(signal.SIGTERM)
                break
            time.sleep(0.005)
    codes = []
    for process, log in started:
        try:
            codes.append(process.wait(timeout=120))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            codes.append(process.wait())
        log.close()
    return codes


def write_shards() -> None:
    """The data: 320 rows of 8 features and 3 classes as four Parquet shards in the bucket
    (row groups of 20 rows), read by each node through a cache of its own."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    x = np.random.default_rng(0).normal(size=(320, 8))
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.5)
    for part in range(4):
        rows = slice(80 * part, 80 * (part + 1))
        table = pa.table({**{f"f{j}": x[rows, j] for j in range(8)}, "label": y[rows]})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=20, write_page_checksum=True)
        s3fs.S3FileSystem().pipe(f"nodes/data/part-{part:05d}.parquet", sink.getvalue())


def s3_bytes(path: str) -> bytes:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return bytes(fs.cat_file(path))


def epoch_rows(path: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in s3_bytes(path).decode().splitlines()]
    timing = ("seconds", "samples_per_s", "checkpoint_s")
    return [{k: v for k, v in r.items() if k not in timing} for r in rows if r["kind"] == "epoch"]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The S3 server, and the uninterrupted two-node run in it (``s3://nodes/straight``);
    the environment that points at it. Its final uploads outlast the processes' collective
    timeout: node 1 waits for them and both end well (node 1's process timed out in its
    last barrier, exit 1 with tracebacks, the run bitwise right)."""
    tmp = tmp_path_factory.mktemp("straight")
    with local_s3("nodes") as env:  # (a bucket of its own: moto keeps a process's buckets)
        env = {**env, "OMP_NUM_THREADS": "1"}
        write_shards()
        done = nodes(tmp, env, "s3://nodes/straight", slow="end")
        said = [(tmp / f"node{node}.log").read_text() for node in (0, 1)]
        assert done == [0, 0], said[0][-3000:] + said[1][-3000:]
        assert "Traceback" not in said[0] + said[1], said[1][-3000:]
        for node in (0, 1):  # each read the shards through its own cache, removed at the end
            cache = tmp / f"node{node}-cache" / "shards"
            assert cache.is_dir() and not list(cache.rglob("*.arrow")), node
        yield env


def test_two_nodes_train_one_run_on_s3_and_resume_it_bitwise(
    bucket: dict[str, str], tmp_path: Path
) -> None:
    env = bucket
    codes = nodes(tmp_path, env, "s3://nodes/killed", kill_node_1=7)
    assert codes[0] != 0 and codes[1] != 0, codes  # (node 1 killed; node 0 left alone)
    # (rank 0's pull outlasts the collective timeout: node 1 waits for it, it timed out)
    resumed = nodes(tmp_path, env, "s3://nodes/killed", "--resume", slow="pull")
    said = (tmp_path / "node0.log").read_text()
    assert resumed == [0, 0], said[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    # from a checkpoint before the kill (step 6, or 3 when uploads lagged under load)
    found = re.search(r"resumed from 's3://nodes/killed/checkpoints/(step-0+([36]))' at", said)
    assert found, said[-3000:]
    # node 1 read it from its own disk: its first process pulled it there
    pulled = list((tmp_path / "node1-cache").glob("remote-runs/*/run/checkpoints/step-*"))
    assert [path.name for path in pulled] == [found.group(1)], pulled
    straight = s3_bytes("nodes/straight/model.safetensors")
    assert s3_bytes("nodes/killed/model.safetensors") == straight
    assert epoch_rows("nodes/killed/metrics.jsonl") == epoch_rows("nodes/straight/metrics.jsonl")
    # the same two processes on one node: the same weights
    one_node = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        "2", "-m", "glassloop", "train", *SMALL, "--run-dir", "s3://nodes/one-node",
    ]  # fmt: skip
    done = subprocess.run(one_node, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert s3_bytes("nodes/one-node/model.safetensors") == straight


def test_a_stop_signal_to_one_node_lands_one_checkpoint_in_the_bucket(
    bucket: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM to node 1's torchrun alone (a scheduler's stop on one machine): both nodes stop
    after the same step, its checkpoint complete in the bucket, and the resumed run ends
    bitwise the uninterrupted one."""
    rows = ["--set", "train.log_every=1", "--set", "train.progress=lines"]
    codes = nodes(tmp_path, bucket, "s3://nodes/stopped", *rows, term=6)
    assert codes[0] != 0 and codes[1] != 0, codes
    latest = s3_bytes("nodes/stopped/checkpoints/latest").decode().strip()
    meta = json.loads(s3_bytes(f"nodes/stopped/checkpoints/{latest}/meta.json"))
    assert meta["world_size"] == 2 and 6 <= meta["step"] < 32, meta
    resumed = nodes(tmp_path, bucket, "s3://nodes/stopped", *rows, "--resume")
    said = (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    assert resumed == [0, 0], said[-3000:]
    assert f"resumed from 's3://nodes/stopped/checkpoints/{latest}' at" in said
    assert s3_bytes("nodes/stopped/model.safetensors") == s3_bytes(
        "nodes/straight/model.safetensors"
    )
    assert epoch_rows("nodes/stopped/metrics.jsonl") == epoch_rows("nodes/straight/metrics.jsonl")


def test_fsdp_on_several_nodes_keeps_its_run_on_a_shared_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP writes each node's shards on that node; a run on object storage uploads one
    node's local copy, so that pair is one line (DDP on several nodes is not)."""
    from glassloop.distributed.world import World
    from glassloop.errors import GlassloopError
    from glassloop.run_dir.run import RunDir

    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path))
    two_nodes = World(rank=0, size=4, local_rank=0, local_size=2)
    RunDir("memory://bucket/ddp", two_nodes).mirror(3, print, sharded=False)
    with pytest.raises(GlassloopError, match="'fsdp' on several nodes writes each node's shards"):
        RunDir("memory://bucket/fsdp", two_nodes).mirror(3, print, sharded=True)
    RunDir("memory://bucket/fsdp", World(0, 2, 0, 2)).mirror(3, print, sharded=True)  # one node
