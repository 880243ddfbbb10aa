"""Run directories on object storage (glassloop.run_dir.remote): a real S3 server over HTTP on
127.0.0.1 (moto's server mode, started and stopped here), reached through the real client
(s3fs) in new processes; ``memory://`` for what needs no process of its own.

What is pinned: ``glassloop train --run-dir s3://...`` keeps the run in the bucket (never a
local folder named ``s3:``); killed with SIGKILL while its uploads are in flight and resumed
with ``--resume`` in a new process, the final weights equal an uninterrupted run's bit for
bit; a checkpoint cut short by a kill (no manifest) or damaged in the bucket is never resumed
from; pruning leaves the newest complete ones; credentials are never written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from cli_runner import run_glassloop
from s3_server import SECRET, local_s3
from safetensors.torch import load
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Callback, Trainer
from glassloop.errors import CheckpointWriteError
from glassloop.options import CheckpointConfig
from glassloop.run_dir.lease import RunLeased
from glassloop.step.throughput import TIMING
from glassloop.tools import verify_resume

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_remote_run")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with local_s3("bucket") as env:
        yield env


SMALL = [
    "--set", "data.name=synthetic", "--set", "data.num_samples=320", "--set", "data.batch_size=32",
    "--set", "data.num_features=8", "--set", "model.hidden=[16]", "--set", "train.epochs=1",
    "--set", "checkpoint.every_n_steps=1", "--set", "checkpoint.keep_last=2",
    "--set", "train.progress=none",
]  # fmt: skip


def train(cwd: Path, env: dict[str, str], url: str, *extra: str) -> Any:
    """``glassloop train`` in a new process (forked: tests/forkserver.py), with ``env``."""
    cache = {"GLASSLOOP_CACHE_DIR": str(cwd / "cache")}
    return forkserver.run(
        [sys.executable, "-m", "glassloop", "train", *SMALL, "--run-dir", url, *extra],
        cwd=cwd, env={**env, **cache}, timeout=300,
    )  # fmt: skip


def s3_files(url: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(fs.find(url.removeprefix("s3://")))


def s3_bytes(path: str) -> bytes:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return bytes(fs.cat_file(path.removeprefix("s3://")))


# `glassloop train` that SIGKILLs itself in the middle of uploading a checkpoint: after the
# second object of the first checkpoint from step 6 on (the ones before it complete).
KILL_MID_UPLOAD = """
import os, signal, sys
import glassloop.run_dir.remote as remote
from glassloop.cli.main import main

real = remote.RemoteRun._upload_checkpoint

def upload(self, path):
    if int(path.name.split("-")[-1]) >= 6:
        put, calls = self.fs.put_file, []
        def put_then_die(local, target, **kwargs):
            put(local, target, **kwargs)
            calls.append(target)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        self.fs.put_file = put_then_die
    return real(self, path)

remote.RemoteRun._upload_checkpoint = upload
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_s3_run_resumes_bitwise(tmp_path: Path, s3: dict[str, str]) -> None:
    """Uninterrupted vs killed with SIGKILL in the middle of an upload and resumed with
    --resume in a new process: the cut checkpoint (objects, no manifest) is never used, the
    resume starts from the newest complete one, and the final weights and every metric row
    equal the uninterrupted run's; nothing named s3: in the working directory; no secret in
    any file written, here or in the bucket."""
    from cli_runner import run_glassloop

    with pytest.MonkeyPatch.context() as patch:  # (the uninterrupted run: in this process)
        patch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))
        done = run_glassloop("train", *SMALL, "--run-dir", "s3://bucket/straight", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "kill.py").write_text(KILL_MID_UPLOAD)
    killed = forkserver.run(
        [sys.executable, "kill.py", "train", *SMALL, "--run-dir", "s3://bucket/killed"],
        cwd=tmp_path, env={**s3, "GLASSLOOP_CACHE_DIR": str(tmp_path / "cache")}, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    folders = {p.split("/")[3] for p in s3_files("s3://bucket/killed/checkpoints") if "/step-" in p}
    complete = {p.split("/")[3] for p in s3_files("s3://bucket/killed/checkpoints")
                if p.endswith("/manifest.json")}  # fmt: skip
    cut = sorted(folders - complete)
    assert len(cut) == 1 and cut[0] > max(complete), (folders, complete)  # (cut mid-upload)
    assert json.loads(s3_bytes("s3://bucket/killed/run.json"))["status"] == "running"
    # Resumed by its URL alone, as a local run by its folder: the run's own config.json.
    resumed = forkserver.run(
        [sys.executable, "-m", "glassloop", "train", "--run-dir", "s3://bucket/killed", "--resume"],
        cwd=tmp_path, env={**s3, "GLASSLOOP_CACHE_DIR": str(tmp_path / "cache")}, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming with the run's own config: s3://bucket/killed/config.json" in resumed.stdout
    assert f"resumed from 's3://bucket/killed/checkpoints/{max(complete)}'" in resumed.stdout
    straight = load(s3_bytes("s3://bucket/straight/model.safetensors"))
    again = load(s3_bytes("s3://bucket/killed/model.safetensors"))
    assert straight.keys() == again.keys()
    for key, value in straight.items():
        assert torch.equal(value, again[key]), key
    run = json.loads(s3_bytes("s3://bucket/killed/run.json"))
    assert run["status"] == "finished" and run["remote"] == "s3://bucket/killed"
    # Every reported number: the metric rows of the resumed run equal the straight run's.
    rows = [
        json.loads(line) for line in s3_bytes("s3://bucket/straight/metrics.jsonl").splitlines()
    ]
    rows_again = [
        json.loads(line) for line in s3_bytes("s3://bucket/killed/metrics.jsonl").splitlines()
    ]
    timing = TIMING
    strip = [{k: v for k, v in r.items() if k not in timing} for r in rows]
    strip_again = [{k: v for k, v in r.items() if k not in timing} for r in rows_again]
    assert strip == strip_again
    # Pruning: keep_last = 2 complete checkpoints in the bucket, latest names the newest.
    steps = sorted(
        {p.split("/")[3] for p in s3_files("s3://bucket/killed/checkpoints") if "/step-" in p}
    )
    assert len(steps) == 2, steps
    assert s3_bytes("s3://bucket/killed/checkpoints/latest").decode().strip() == steps[-1]
    assert not (tmp_path / "s3:").exists()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for name in s3_files("s3://bucket/killed"):
        assert SECRET.encode() not in s3_bytes(name), name


# --------------------------------------------------------------------------- memory://
class StopAt(Callback):
    """Ctrl-C after ``step`` (the run stops as a user's would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, step: int, loss: Any) -> None:
        if step == self.step:
            raise KeyboardInterrupt


def trainer(url: str, *callbacks: Callback, keep_last: int = 3) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        run_dir=url,
        checkpoint=CheckpointConfig(every_n_steps=1, keep_last=keep_last),
        callbacks=callbacks,
    )


def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    return DataLoader(data, batch_size=8, shuffle=True, generator=g)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def memory() -> Any:
    import fsspec

    return fsspec.filesystem("memory")


def test_a_cut_upload_or_a_damaged_object_is_never_resumed_from(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the bucket after a stop at step 7: step 6 without its manifest (a kill during its
    upload) and step 5's weights damaged. A resume in a fresh local copy skips both (a line
    names the damaged one), resumes from step 4, and ends where an uninterrupted run ends."""
    url = "memory://bucket/cut"
    with pytest.raises(KeyboardInterrupt):
        trainer(url, StopAt(7), keep_last=10).fit(loader(), epochs=2)
    fs = memory()
    assert fs.exists("/bucket/cut/checkpoints/step-00000006/manifest.json")
    fs.rm_file("/bucket/cut/checkpoints/step-00000006/manifest.json")
    damaged = "/bucket/cut/checkpoints/step-00000005/model.safetensors"
    data = bytearray(fs.cat_file(damaged))
    data[-1] ^= 0xFF
    fs.pipe_file(damaged, bytes(data))
    # Any machine (this one's local copy is rebuilt from the bucket) resumes from step 4.
    resumed = trainer(url, keep_last=3)
    resumed.fit(loader(), epochs=2, resume="auto")
    out = capsys.readouterr().out
    assert (
        "warning: checkpoint: 'memory://bucket/cut/checkpoints/step-00000005': "
        "model.safetensors fails its SHA-256 check (corrupt or modified) (after download)"
    ) in out
    assert "at step 4 " in out
    straight = trainer("memory://bucket/straight")
    straight.fit(loader(), epochs=2)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert not fs.exists("/bucket/cut/checkpoints/step-00000006")  # pruned: incomplete


def test_a_fresh_run_never_overwrites_a_remote_run(cache: Path) -> None:
    url = "memory://bucket/taken"
    trainer(url).fit(loader(), epochs=1)
    with pytest.raises(Exception, match="'memory://bucket/taken' already holds checkpoints"):
        trainer(url).fit(loader(), epochs=1)


def test_the_local_copy_is_never_a_folder_of_someone_else(cache: Path) -> None:
    """A folder where the local copy goes that glassloop did not make is refused, untouched."""
    from glassloop.run_dir.remote import RemoteRun

    remote = RemoteRun("memory://bucket/mine")
    remote.container.mkdir(parents=True)
    (remote.container / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="is not glassloop's"):
        trainer("memory://bucket/mine").fit(loader(), epochs=1)
    assert (remote.container / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- races and failures
def commit(run_dir: Path, step: int, rows: int) -> Path:
    """A committed local checkpoint of ``step`` whose state.json has ``rows`` rows (the
    same step saved again, as at an epoch's end, differs in size)."""
    from glassloop.run_dir.local_store import LocalStore
    from glassloop.storage.snapshot import snapshot

    state = {"history": [{"x": i} for i in range(rows)], "w": torch.zeros(3)}
    return LocalStore(run_dir).commit(snapshot(nn.Linear(4, 4), state, {"step": step}))


def on_first_put(remote: Any, action: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``action`` while the first object is uploaded (the filesystem's own put_file,
    with a moment of ours in it: what another thread does meanwhile). fsspec shares one
    instance per filesystem: monkeypatch puts the method back after the test."""
    real, calls = remote.fs.put_file, []

    def put_file(local: str, target: str, **kwargs: Any) -> Any:
        calls.append(target)
        if len(calls) == 1:
            action()
        return real(local, target, **kwargs)

    monkeypatch.setattr(remote.fs, "put_file", put_file)


def test_a_step_saved_again_during_its_upload_is_uploaded_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The epoch's end saves the step just saved while its upload runs: no failure; the
    bucket ends with the newer one, complete."""
    from glassloop.run_dir.checkpoints import read_checkpoint
    from glassloop.run_dir.remote import RemoteRun

    remote = RemoteRun("memory://bucket/again")
    remote.keep_last = 3
    remote.local.mkdir(parents=True)
    first = commit(remote.local, 100, 1)
    saved_again = threading.Event()

    def save_again() -> None:  # (the training thread's next commit and push)
        remote.push_checkpoint(commit(remote.local, 100, 50))
        saved_again.set()

    on_first_put(remote, save_again, monkeypatch)
    remote.push_checkpoint(first)
    saved_again.wait()  # (the end of training comes after its last push)
    remote.close()  # raises the upload's failure, if any
    elsewhere = RemoteRun("memory://bucket/again", local=cache / "elsewhere")
    assert elsewhere.pull() == "step-00000100"
    pulled = read_checkpoint(elsewhere.local / "checkpoints" / "step-00000100")
    assert len(pulled.state["history"]) == 50


def test_a_kill_while_a_step_is_uploaded_again_leaves_a_complete_one(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_last = 1: step 200 uploaded, then saved again and cut during its new upload
    (its old manifest already gone): the bucket still holds a complete checkpoint (two are
    kept), and a resume elsewhere starts from it."""
    from glassloop.errors import CheckpointWriteError
    from glassloop.run_dir.remote import RemoteRun

    remote = RemoteRun("memory://bucket/cut-again")
    remote.keep_last = 1
    remote.local.mkdir(parents=True)
    remote.push_checkpoint(commit(remote.local, 100, 1))
    remote.push_checkpoint(commit(remote.local, 200, 1))
    remote.close()

    def cut() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    on_first_put(remote, cut, monkeypatch)
    remote.push_checkpoint(commit(remote.local, 200, 50))
    with pytest.raises(CheckpointWriteError, match="uploading to memory://bucket/cut-again"):
        remote.close()
    elsewhere = RemoteRun("memory://bucket/cut-again", local=cache / "elsewhere")
    assert elsewhere.pull() == "step-00000100"


def test_a_remote_that_cannot_be_read_is_an_error_never_a_fresh_start(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from glassloop.errors import CheckpointError
    from glassloop.run_dir.remote import RemoteRun

    trainer("memory://bucket/unreadable").fit(loader(), epochs=1)
    remote = RemoteRun("memory://bucket/unreadable", local=cache / "elsewhere")

    def reset(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(remote.fs, "get_file", reset)
    with pytest.raises(CheckpointError, match=r"cannot read the remote run .*nothing was changed"):
        remote.pull()


def test_a_failed_upload_never_hides_the_error_a_run_ends_with(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C with a failed upload pending: the run ends with KeyboardInterrupt (a requeue
    policy reads its exit code), the upload's failure a warning; a URL's secret nowhere."""
    url = "memory://AKIA:sEcReT@bucket/masked"
    run = trainer(url, StopAt(1))  # (before the first checkpoint: the end's upload fails)
    assert run.run_log.remote is not None

    fs = run.run_log.remote.fs
    put, pipe = fs.put_file, fs.pipe_file

    def refusing(write: Any) -> Any:
        def refuse(path: str, *args: Any, **kwargs: Any) -> Any:
            if path.endswith("/.lease.json") or "/.generations/" in path:  # (the job's own)
                return write(path, *args, **kwargs)
            raise PermissionError(13, f"Access denied to {url}/x")

        return refuse

    monkeypatch.setattr(fs, "put_file", refusing(put))
    monkeypatch.setattr(fs, "pipe_file", refusing(pipe))
    with pytest.raises(KeyboardInterrupt):
        run.fit(loader(), epochs=1)
    out = capsys.readouterr().out
    assert "warning: checkpoint: uploading to memory://***@bucket/masked failed" in out
    assert "sEcReT" not in out
    for file in cache.rglob("*"):
        assert not file.is_file() or b"sEcReT" not in file.read_bytes(), file


def test_a_filesystem_with_real_folders_gets_every_file(tmp_path: Path, cache: Path) -> None:
    """fsspec's local filesystem (``local://``) has folders that must exist before a file
    goes in: the run lands there whole."""
    target = tmp_path / "bucket"
    trainer(f"local://{target}").fit(loader(), epochs=1)
    assert (target / "model.safetensors").is_file()
    assert (target / "checkpoints" / "latest").read_text().strip() == "step-00000008"
    assert (target / "checkpoints" / "step-00000008" / "manifest.json").is_file()
    assert not [p for p in (target / "report").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "command",
    [
        ["export", "runs/x", "-o", "gs://bucket/w.safetensors"],
        ["predict", "runs/x", "s3://bucket/a.npy"],
        ["predict", "runs/x", "a.npy", "--output", "s3://bucket/p.csv"],
        ["verify-resume", "--kill-at", "3", "--keep", "s3://bucket/keep"],
    ],
)
def test_a_url_where_a_command_takes_a_local_path_is_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    """A run is read from its URL and written to it by train --run-dir; every other path
    argument given a URL is one line and exit 2, and no local folder named s3: or gs: is made."""
    from cli_runner import run_glassloop

    done = run_glassloop(*command, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"glassloop: error: {command[0]}: ")
    assert "is a URL; this argument is a local path" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_the_bucket_is_the_run_whatever_the_local_copy_holds(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local copy is glassloop's cache of the bucket, rebuilt at each start: a damaged
    local checkpoint never blocks a resume, a stale copy of an older run at a reused URL never
    reaches the bucket, and a link placed in the copy is removed, never followed."""
    from glassloop.run_dir.remote import RemoteRun

    url = "memory://bucket/reused"
    trainer(url).fit(loader(), epochs=1)  # 8 steps
    local = RemoteRun(url).local
    newest = local / "checkpoints" / "step-00000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-1] + b"\0")  # damaged here, not in the bucket
    outside = tmp_path / "outside"
    (outside / "step-00000009").mkdir(parents=True)
    (outside / "step-00000009" / ".glassloop").touch()
    (local / "report").rename(tmp_path / "report-was")
    os.symlink(outside, local / "report")
    resumed = trainer(url)
    resumed.fit(loader(), epochs=2, resume="auto")
    assert "resumed from 'memory://bucket/reused/checkpoints/step-00000008'" in (
        capsys.readouterr().out
    )
    assert (outside / "step-00000009" / ".glassloop").exists()  # (the link's target)
    # The bucket emptied and reused: a fresh run there starts fresh, and only its own
    # checkpoints reach the bucket (none of the old run the local copy held).
    fs = memory()
    fs.rm("/bucket/reused", recursive=True)
    fresh = trainer(url, keep_last=10)
    fresh.fit(loader(), epochs=1)
    listed = fs.ls("/bucket/reused/checkpoints", detail=False)
    steps = sorted(p.rsplit("/", 1)[-1] for p in listed)
    assert steps == ["latest"] + [f"step-{n:08d}" for n in range(1, 9)]


def test_a_missing_object_falls_back_and_a_failed_final_upload_is_repaired(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint missing an object in the bucket is skipped like a damaged one; final
    weights that failed to upload are written and uploaded by the next --resume."""
    from glassloop.errors import CheckpointWriteError

    url = "memory://bucket/repair"
    run = trainer(url, keep_last=10)
    assert run.run_log.remote is not None
    real = run.run_log.remote.fs.put_file

    def refuse_weights(local: str, target: str, **kwargs: Any) -> Any:
        if target.endswith("repair/model.safetensors"):
            raise PermissionError(13, "Access denied")
        return real(local, target, **kwargs)

    monkeypatch.setattr(run.run_log.remote.fs, "put_file", refuse_weights)
    with pytest.raises(CheckpointWriteError, match="uploading to memory://bucket/repair"):
        run.fit(loader(), epochs=1)
    monkeypatch.undo()
    fs = memory()
    assert not fs.exists("/bucket/repair/model.safetensors")
    assert json.loads(fs.cat_file("/bucket/repair/run.json"))["status"] != "finished"
    # (which checkpoints completed before the failure depends on the uploads' pace)
    listed = fs.find("/bucket/repair/checkpoints")
    complete = sorted(p.split("/")[-2] for p in listed if p.endswith("/manifest.json"))
    newest, older = complete[-1], complete[-2]
    fs.rm_file(f"/bucket/repair/checkpoints/{newest}/state.json")
    again = trainer(url, keep_last=10)
    again.fit(loader(), epochs=1, resume="auto")
    out = capsys.readouterr().out
    assert f"{newest}': state.json is missing (after download); falling back to an older one" in out
    assert f"resumed from 'memory://bucket/repair/checkpoints/{older}'" in out
    assert fs.exists("/bucket/repair/model.safetensors")
    assert json.loads(fs.cat_file("/bucket/repair/run.json"))["status"] == "finished"


def test_a_run_stopped_before_its_first_checkpoint_reaches_a_folder_filesystem(
    tmp_path: Path, cache: Path
) -> None:
    target = tmp_path / "bucket"
    with pytest.raises(KeyboardInterrupt):
        trainer(f"local://{target}", StopAt(1)).fit(loader(), epochs=1)
    assert json.loads((target / "run.json").read_text())["status"] == "interrupted"


def test_two_processes_keep_a_run_in_a_bucket_and_resume_it(tmp_path: Path) -> None:
    """--nproc 2 with a run directory on another filesystem (fsspec's local:// here, which
    every process and run sees): rank 0 pulls and uploads, the other reads the local copy
    after it; killed after step 4 of 5 and resumed with --resume, the run finishes from the
    bucket's checkpoint and the bucket holds its end. (Two processes resume bitwise:
    test_distributed.py; a bucket's resume is bitwise: test_a_killed_s3_run_resumes_bitwise.)"""
    bucket = tmp_path / "bucket"

    def launch(*extra: str) -> Any:
        return forkserver.run(  # (the launcher forked; torchrun and its workers started)
            [sys.executable, "-m", "glassloop", "train", *SMALL, "--nproc", "2",
             "--run-dir", f"local://{bucket}", *extra],
            cwd=tmp_path, env={**os.environ, "GLASSLOOP_CACHE_DIR": str(tmp_path / "cache")},
            timeout=300,
        )  # fmt: skip

    assert launch("--kill-at-step", "4").returncode != 0
    resumed = launch("--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # (from the newest checkpoint that reached the bucket before the kill: step 1, 2 or 3)
    assert re.search(
        rf"resumed from 'local://{bucket}/checkpoints/step-0000000[123]'", resumed.stdout
    )
    assert json.loads((bucket / "run.json").read_text())["status"] == "finished"
    assert load((bucket / "model.safetensors").read_bytes())


# ---------------------------------------------------------------- what a URL may hold
TOKEN = "Tok3nXq7Zsecret"  # (a bare token as the URL's user part, as a user pastes one)


def everything_written(where: Path) -> bytes:
    """Every byte a run could have left a secret in: the files under ``where`` (the working
    directory and the cache), their names, and every object of the S3 server (its key and
    its bytes), in every bucket."""
    import s3fs

    found = [str(p).encode() + (p.read_bytes() if p.is_file() else b"") for p in where.rglob("*")]
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    for bucket in fs.ls(""):
        found += [key.encode() + bytes(fs.cat_file(key)) for key in fs.find(bucket)]
    return b"\n".join(found)


@pytest.mark.parametrize("url", [f"s3://{TOKEN}@bucket/run", f"s3://ann:{TOKEN}@bucket/run"])
def test_a_secret_in_a_run_url_is_printed_and_written_nowhere(
    tmp_path: Path, s3: dict[str, str], url: str
) -> None:
    """botocore's own error quotes the bucket it was handed (``Invalid bucket name
    "TOKEN@bucket"``): the secret is replaced there too, in the one line the run ends with
    (exit 2), and it is in no file of the working directory or the cache, and in no object
    of the server (new process: nothing remembered from an earlier call)."""
    done = train(tmp_path, s3, url)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert TOKEN not in done.stdout + done.stderr and "***@bucket" in done.stderr
    assert TOKEN.encode() not in everything_written(tmp_path)


@pytest.mark.parametrize("tail", [f"?secret={TOKEN}", f"#{TOKEN}", f"?x=1#token={TOKEN}"])
def test_a_query_or_a_fragment_in_a_run_url_is_refused(
    tmp_path: Path, s3: dict[str, str], tail: str
) -> None:
    """A query or a fragment would become part of every object's key: one line, exit 2,
    nothing created in the bucket."""
    from cli_runner import run_glassloop

    before = s3_files("s3://bucket")
    done = run_glassloop("train", *SMALL, "--run-dir", f"s3://bucket/q{tail}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "has a query ('?...') or a fragment ('#...')" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and TOKEN not in done.stderr
    assert s3_files("s3://bucket") == before


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_a_bucket_that_does_not_exist_is_one_line_and_never_created(
    tmp_path: Path, s3: dict[str, str], resume: list[str]
) -> None:
    """A mistyped bucket is not created and trained into (a fresh run), nor resumed as a fresh
    start: one line, exit 2, the bucket still missing. A prefix that does not exist yet in a
    bucket that does is a fresh run (every other test here)."""
    import s3fs
    from cli_runner import run_glassloop

    done = run_glassloop(
        "train", *SMALL, "--run-dir", "s3://typo-bucket/run", *resume, cwd=tmp_path
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "glassloop: error: run: the bucket 'typo-bucket' of s3://typo-bucket/run does not "
        "exist (or these credentials cannot see it); glassloop never creates one: create it "
        "(e.g. aws s3 mb s3://BUCKET) or correct the URL"
    )
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert "typo-bucket" not in fs.ls("")


def test_a_remote_resume_falls_back_past_weights_that_do_not_fit(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    """The newest checkpoint in the bucket has weights of 20,000 keys that are not the
    model's, its manifest consistent: a resume stopped with an error line of megabytes (and a
    local one too). In a new process it falls back to the one before, with one short line,
    as for a damaged checkpoint."""
    import hashlib

    import s3fs
    from safetensors.torch import save

    url = "s3://bucket/fallback"
    per_epoch = ["--set", "checkpoint.every_n_steps=0", "--set", "train.epochs=2"]
    first = train(tmp_path, s3, url, *per_epoch)
    assert first.returncode == 0, first.stderr
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    newest = "bucket/fallback/checkpoints/step-00000016"
    wrong = save({f"wrong.layer{i}.weight": torch.zeros(1) for i in range(20_000)})
    manifest = json.loads(fs.cat_file(f"{newest}/manifest.json"))
    entry = {"size": len(wrong), "sha256": hashlib.sha256(wrong).hexdigest()}
    manifest["files"]["model.safetensors"] = entry
    fs.pipe_file(f"{newest}/model.safetensors", wrong)
    fs.pipe_file(f"{newest}/manifest.json", json.dumps(manifest).encode())
    more = ["--set", "train.epochs=3", "--allow-config-change", "--resume"]  # (on purpose)
    resumed = train(tmp_path, s3, url, *per_epoch, *more)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = (resumed.stdout + resumed.stderr).splitlines()
    fell_back = [line for line in said if "falling back to an older one" in line]
    assert len(fell_back) == 1 and len(fell_back[0]) < 1000, fell_back
    assert "unexpected keys ['wrong.layer0.weight'" in fell_back[0]
    assert "and 19,995 more" in fell_back[0]
    assert f"resumed from '{url}/checkpoints/step-00000008'" in resumed.stdout


def test_a_remote_manifest_nested_too_deep_is_passed_over(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest nested 200,000 deep: a RecursionError escaped the download; now the
    resume falls back to the checkpoint before it, as for any unreadable manifest."""
    url = "memory://bucket/deep"
    trainer(url).fit(loader(), epochs=1)
    fs = memory()
    steps = sorted(p for p in fs.ls("/bucket/deep/checkpoints", detail=False) if "step-" in p)
    deep = b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    fs.pipe_file(f"{steps[-1]}/manifest.json", deep)
    capsys.readouterr()
    trainer(url).fit(loader(), epochs=2, resume="auto", allow_config_change=True)
    said = capsys.readouterr().out.splitlines()
    fell_back = [line for line in said if "falling back to an older one" in line]
    assert len(fell_back) == 1 and len(fell_back[0]) < 1000, said
    assert f"resumed from '{url}/checkpoints/{steps[-2].rsplit('/', 1)[-1]}'" in "\n".join(said)


def test_a_remote_run_is_called_by_its_url(tmp_path: Path, cache: Path) -> None:
    """The header, the weights and the report are named by the run's URL, where they end up;
    the local copy is named once, as what it is (a newcomer took the cache path for the run)."""
    lines = [*SMALL[:-2], "--set", "train.progress=lines"]
    done = run_glassloop("train", *lines, "--run-dir", "memory://shown/run", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.splitlines()
    copy = next(line for line in said if line.startswith("run directory: "))
    assert re.fullmatch(r"run directory: memory://shown/run \(local copy: .+\)", copy), copy
    assert (
        "weights: memory://shown/run/model.safetensors; "
        "report: memory://shown/run/report/index.html"
    ) in said, said


def test_every_command_reads_a_run_from_its_url(
    tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval, predict, export, report, runs and verify-resume take a run's URL as they take a
    local run directory, on a machine that never saw the run (a cache of its own): every
    number they print equals what they print for the same run copied down by hand, and the
    bucket is byte for byte what it was (nothing is written to it)."""
    import numpy as np
    import s3fs

    url = "s3://bucket/reads/one"
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "trainer-cache"))
    done = run_glassloop("train", *SMALL, "--run-dir", url, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    fs.get("bucket/reads/one", str(tmp_path / "copied"), recursive=True)  # the hand's copy
    before = {path: s3_bytes(f"s3://{path}") for path in s3_files("s3://bucket/reads")}
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "reader-cache"))  # another machine
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).normal(size=(3, 8)).astype("float32"))

    for command, extra in [("eval", ()), ("predict", ("rows.npy",))]:
        remote = run_glassloop(command, url, *extra, cwd=tmp_path)
        local = run_glassloop(command, str(tmp_path / "copied"), *extra, cwd=tmp_path)
        assert remote.returncode == 0 == local.returncode, remote.stderr + local.stderr
        assert f"read {url} into a local copy" in remote.stderr
        # every number the same; a path is the URL, never the reader's cache
        assert remote.stdout == local.stdout.replace(str(tmp_path / "copied"), url)
        assert "reader-cache" not in remote.stdout
    for run, name in ((url, "remote.safetensors"), (str(tmp_path / "copied"), "local.safetensors")):
        done = run_glassloop("export", run, "--output", name, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "remote.safetensors").read_bytes() == (
        tmp_path / "local.safetensors"
    ).read_bytes()
    report = run_glassloop("report", url, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "(in the local copy; the bucket is unchanged)" in report.stdout
    listed = run_glassloop("runs", "s3://bucket/reads", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"^{url} +finished +8 +1 ", listed.stdout, re.MULTILINE), listed.stdout
    forkserver.start_children_here(monkeypatch, verify_resume)  # (its runs forked)
    proved = run_glassloop("verify-resume", url, "--kill-at", "4", cwd=tmp_path)
    assert proved.returncode == 0, proved.stdout + proved.stderr
    assert "resume is exact" in proved.stdout
    assert {path: s3_bytes(f"s3://{path}") for path in s3_files("s3://bucket/reads")} == before
    nothing = run_glassloop("eval", "s3://bucket/reads/none", cwd=tmp_path)
    assert nothing.returncode == 2, nothing.stderr
    assert "s3://bucket/reads/none holds no run" in nothing.stderr


class SecondJob(Callback):
    """At step 2, another machine (a cache of its own) starts the same URL: its line."""

    def __init__(self, url: str, cache: Path) -> None:
        self.url, self.cache = url, cache
        self.said: tuple[str, str] | None = None

    def on_step_end(self, trainer: Any, step: int, loss: torch.Tensor) -> None:
        if step == 2:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("GLASSLOOP_CACHE_DIR", str(self.cache))
                done = run_glassloop("train", *SMALL, "--run-dir", self.url)
            self.said = (str(done.returncode), done.stderr)


def lease(url: str) -> dict[str, Any] | None:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    path = url.removeprefix("s3://") + "/.lease.json"
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def test_one_job_writes_a_url_and_a_dead_jobs_lease_is_taken_over(
    tmp_path: Path, s3: dict[str, str], cache: Path
) -> None:
    """A second job on a URL another job is training into (another machine: its own local
    copy, so no lock of this machine sees the first) is refused in one line naming the
    first, while the first trains on and ends; it gives the lease back at its end. A lease
    whose heartbeat stopped (a job killed on another machine) is taken over and said; one
    that still beats is refused with the wait until it would expire."""
    import s3fs

    url = "s3://bucket/lease/run"
    second = SecondJob(url, tmp_path / "other-machine")
    trainer(url, second).fit(loader(), epochs=1)
    assert second.said is not None
    code, said = second.said
    assert code == "2", said
    assert said.startswith(f"glassloop: error: run: {url} is being written by another job (host ")
    assert f"PID {os.getpid()}, last heartbeat" in said and len(said.strip().splitlines()) == 1
    assert lease(url) is None  # given back at the end
    assert s3_files(url) and "lease/run/model.safetensors" in " ".join(s3_files(url))

    fs = s3fs.S3FileSystem()
    record = {"host": "node-7", "pid": 4242, "token": "x"}
    fs.pipe_file("bucket/lease/run/.lease.json", json.dumps({**record, "heartbeat": 1.0}).encode())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer(url).fit(loader(), epochs=2, resume="auto")
    assert "taking over s3://bucket/lease/run from a job that stopped without ending (host " in (
        out.getvalue()
    )
    assert lease(url) is None
    fresh = {**record, "heartbeat": time.time()}
    fs.pipe_file("bucket/lease/run/.lease.json", json.dumps(fresh).encode())
    with pytest.raises(RunLeased, match=r"host node-7, PID 4242, .* expires in (29|30) s"):
        trainer(url).fit(loader(), epochs=3, resume="auto")
    assert lease(url) == fresh  # (a refused job never touches another's lease)


def test_a_job_whose_run_was_taken_over_stops_and_uploads_nothing_more(
    s3: dict[str, str], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that stalled past its lease's expiry and was taken over (the other job's lease
    and a newer generation in the bucket, as a takeover leaves them) finds the newer
    generation before its next write: it stops at its next step row (exit 3's error), and
    nothing it would upload after that reaches the bucket."""
    import s3fs

    import glassloop.run_dir.lease as leases

    monkeypatch.setattr(leases, "HEARTBEAT_S", 0.05)
    url, fs = "s3://bucket/lease/taken", s3fs.S3FileSystem()

    class TakenOver(Callback):
        def on_step_end(self, trainer: Any, step: int, loss: torch.Tensor) -> None:
            if step != 3:
                return
            deadline = time.monotonic() + 30  # (a checkpoint in first: bounded)
            while not fs.exists("bucket/lease/taken/checkpoints/latest"):
                assert time.monotonic() < deadline, "no checkpoint reached the bucket in 30 s"
                threading.Event().wait(0.01)
                fs.invalidate_cache()
            theirs = {"host": "node-9", "pid": 9, "token": "theirs", "heartbeat": time.time()}
            fs.pipe_file("bucket/lease/taken/.lease.json", json.dumps(theirs).encode())
            newer = f"bucket/lease/taken/.generations/{trainer.run.remote.lease.generation + 1:08d}"
            fs.pipe_file(f"{newer}/record.json", b'{"host": "node-9", "pid": 9}', mode="create")
            deadline = time.monotonic() + 30  # (the heartbeat thread sees it: bounded)
            while trainer.run.remote.lease.lost() is None and time.monotonic() < deadline:
                threading.Event().wait(0.01)

    with pytest.raises(CheckpointWriteError, match=r"taken over by another job \(host node-9"):
        trainer(url, TakenOver()).fit(loader(), epochs=1)  # (8 steps, a checkpoint each)
    fs.invalidate_cache()
    # (an upload in flight when the newer generation came is cut at its next write)
    steps = re.findall(r"checkpoints/step-(\d+)/", " ".join(fs.find("bucket/lease/taken")))
    assert steps and max(int(step) for step in steps) <= 3, steps
    assert lease(url) is not None and lease(url)["token"] == "theirs"  # (never removed)


# `glassloop train` that stops itself (SIGSTOP: a paused VM, a stalled node) just before the
# NTH write whose path matches PATTERN (after that write's fence, before its request):
# ``python freeze.py PATTERN NTH train ...``. Each checkpoint waits for its upload (up to 5 s:
# none is skipped for a newer one), so the NTH is the NTH checkpoint's.
FREEZE_AT = """
import os, re, signal, sys, threading
import glassloop.run_dir.fsspec_store as stores
import glassloop.run_dir.remote as remote
from glassloop.cli.main import main

upload, push, done = remote.RemoteRun._upload_newest, remote.RemoteRun.push_checkpoint, []

def upload_then_say(self, path):
    try:
        return upload(self, path)
    finally:
        done[0].set()

def push_and_wait(self, path):
    done[:] = [threading.Event()]
    push(self, path)
    done[0].wait(5)

remote.RemoteRun._upload_newest, remote.RemoteRun.push_checkpoint = upload_then_say, push_and_wait

pattern, nth, seen = re.compile(sys.argv.pop(1)), int(sys.argv.pop(1)), []
made = stores.FsspecStore.__init__

def freeze_at(path):
    if pattern.search(path):
        seen.append(path)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGSTOP)

def init(self, fs, *args, **kwargs):
    made(self, fs, *args, **kwargs)
    if not getattr(fs, "freezes", False):
        fs.freezes, put, pipe = True, fs.put_file, fs.pipe_file
        fs.put_file = lambda local, path, **kw: (freeze_at(path), put(local, path, **kw))[1]
        fs.pipe_file = lambda path, data, **kw: (freeze_at(path), pipe(path, data, **kw))[1]

stores.FsspecStore.__init__ = init
sys.exit(main(sys.argv[1:]))
"""


def until(condition: Any, what: str, limit: float = 60.0) -> None:
    """Poll ``condition()`` (a process's state has no event to wait on) up to ``limit`` s."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.02)


def frozen(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:  # (ended meanwhile)
        return False


FROZEN_AT = {
    "upload": "checkpoints/step-\\d{8}/model\\.safetensors$",  # mid-upload of a checkpoint
    "commit": "checkpoints/latest$",  # mid-commit: its manifest in, `latest` not
    "metrics": "stale-metrics/metrics\\.jsonl$",  # the run's files: metrics.jsonl at the top
}


@pytest.mark.parametrize("where", FROZEN_AT)
def test_a_job_frozen_mid_write_and_taken_over_writes_nothing_a_reader_takes(
    tmp_path: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Job A freezes (SIGSTOP) at its third write of ``where``, past that write's lease
    check; job B on another machine takes the run over once A's lease expires and trains
    it on, one epoch more than A's two (A got no further than their end), pruning A's
    checkpoints; then A goes on (SIGCONT). A stops at once (exit 3, taken over), and what
    its write in flight did is never what a reader takes: ``latest`` names B's last step,
    run.json says finished, metrics.jsonl holds B's three epoch rows, the run's record names
    B's last checkpoint, and a --resume in a new process reads B's end ("already finished",
    the rows intact). (Written freely, A's `latest`, checkpoint or metrics.jsonl had taken
    the run back to A's step.)"""
    import s3fs

    import glassloop.run_dir.lease as leases
    from glassloop.run_dir.fsspec_store import FsspecStore

    url, two = f"s3://bucket/stale-{where}", ["--set", "train.epochs=2"]
    (tmp_path / "freeze.py").write_text(FREEZE_AT)
    job_a = forkserver.Popen(
        [sys.executable, "freeze.py", FROZEN_AT[where], "3", "train", *SMALL, *two,
         "--run-dir", url],
        cwd=tmp_path, env={**s3, "GLASSLOOP_CACHE_DIR": str(tmp_path / "a")},
        start_new_session=True,
    )  # fmt: skip
    try:
        until(lambda: job_a.poll() is not None or frozen(job_a.pid), "job A to freeze")
        assert job_a.poll() is None, job_a.communicate()
        monkeypatch.setattr(leases, "EXPIRES_S", 0.5)  # (B's wait for A's lease)
        until(lambda: time.time() - (lease(url) or {})["heartbeat"] > 0.5, "A's lease to expire")
        monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "b"))  # another machine
        more = ["--set", "train.epochs=3", "--allow-config-change", "--resume"]
        job_b = run_glassloop("train", *SMALL, "--run-dir", url, *more, cwd=tmp_path)
        assert job_b.returncode == 0, job_b.stdout + job_b.stderr
        assert f"run: taking over {url} from a job that stopped without ending" in job_b.stdout
        job_a.send_signal(signal.SIGCONT)
        _, said = job_a.communicate(timeout=120)
    finally:
        if job_a.poll() is None:
            os.killpg(job_a.pid, signal.SIGKILL)
            job_a.communicate()
    assert job_a.returncode == 3, said[-3000:]
    assert f"run: {url} was taken over by another job (host " in said
    assert s3_bytes(f"{url}/checkpoints/latest") == b"step-00000024\n"
    assert json.loads(s3_bytes(f"{url}/run.json"))["status"] == "finished"
    rows = [json.loads(line) for line in s3_bytes(f"{url}/metrics.jsonl").splitlines()]
    assert [row["epoch"] for row in rows if row["kind"] == "epoch"] == [1, 2, 3], rows
    store = FsspecStore(s3fs.S3FileSystem(), url[5:], tmp_path / "reader", shown=url)
    assert store.resolve() == 2  # (a checkpoint A brought back after B pruned it: not named)
    assert store.complete()[-1] == "step-00000024" and store.listed is not None
    assert store.listed["step-00000024"] == 2
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "c"))  # a third machine
    again = train(tmp_path, s3, url, "--set", "train.epochs=3", "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "run already finished at step 24 (epoch 3/3); nothing to do" in again.stdout
    rows_again = [json.loads(line) for line in s3_bytes(f"{url}/metrics.jsonl").splitlines()]
    assert rows_again == rows


def test_a_planted_lease_or_run_json_neither_blocks_a_url_nor_prints_a_forged_line(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a store holds is anyone's text. A lease nested 100,000 deep, or whose heartbeat
    is 1e11 (3,000 years ahead), is no live job's: the next job takes the run over and says
    why (it blamed the network; it waited 98,203,544,110 s "since 0 s ago"). A host or a
    run.json status with a newline and an escape sequence prints them as ``?``, never as a
    line of its own that reads as glassloop's."""
    url, fs = "memory://planted/run", memory()
    forged = "node-7\nglassloop: error: forged\x1b[2J"
    plants = [
        (b"[" * 100_000 + b"]" * 100_000, "host ?, PID ?, its lease holds no heartbeat"),
        (json.dumps({"host": forged, "pid": 1, "heartbeat": 1e11}).encode(), "in the future"),
    ]
    for epochs, (planted, why) in enumerate(plants, 1):
        fs.pipe_file("/planted/run/.lease.json", planted)
        trainer(url).fit(loader(), epochs=epochs, resume="auto")
        said = [line for line in capsys.readouterr().out.splitlines() if "taking over" in line]
        assert len(said) == 1 and why in said[0], said
    assert "(host node-7?glassloop: error: forged?[2J, PID 1, its heartbeat is " in said[0]
    live = {"host": forged, "heartbeat": time.time()}
    fs.pipe_file("/planted/run/.lease.json", json.dumps(live).encode())
    with pytest.raises(RunLeased) as refused:  # (a live one's: refused, in one line)
        trainer(url).fit(loader(), epochs=3, resume="auto")
    assert "(host node-7?glassloop: error: forged?[2J, PID ?, last heartbeat " in str(refused.value)
    newest = sorted(fs.ls("/planted/run/.generations", detail=False))[-1]
    fs.pipe_file(f"{newest}/run.json", json.dumps({"status": forged, "error": forged}).encode())
    listed = run_glassloop("runs", "memory://planted", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert not [line for line in listed.stdout.splitlines() if line.startswith("glassloop")]
    assert "memory://planted/run  node-7?glassloop: error: forged?[2J" in listed.stdout


def test_an_object_larger_than_its_manifest_says_is_never_downloaded(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read command on a run whose newest checkpoint's weights are 3 MiB in the store where
    its manifest says a few KB: their size is compared before anything is downloaded (a 300
    MB object was read whole first), the read falls back to the one before, with one line."""
    from glassloop.run_dir.remote_read import read_run

    url, fs = "memory://bucket/swollen", memory()
    trainer(url).fit(loader(), epochs=1)
    fs.pipe_file("/bucket/swollen/checkpoints/step-00000008/model.safetensors", b"\0" * (3 << 20))
    fetched, real = [], fs.get_file
    monkeypatch.setattr(fs, "get_file", lambda s, *a, **k: (fetched.append(s), real(s, *a, **k))[1])
    capsys.readouterr()
    with read_run(url) as remote:
        assert (remote.local / "checkpoints" / "step-00000007").is_dir()
    assert "/step-00000008/model.safetensors" not in " ".join(fetched), fetched
    assert (
        "warning: checkpoint: 'memory://bucket/swollen/checkpoints/step-00000008': "
        "model.safetensors has 3145728 bytes, the manifest says "
    ) in capsys.readouterr().out
