"""Run directories on object storage (glassloop.remote): a real S3 server over HTTP on
127.0.0.1 (moto's server mode, started and stopped here), reached through the real client
(s3fs) in new processes; ``memory://`` for what needs no process of its own.

What is pinned: ``glassloop train --run-dir s3://...`` keeps the run in the bucket (never a
local folder named ``s3:``); killed with SIGKILL while its uploads are in flight and resumed
with ``--resume`` in a new process, the final weights equal an uninterrupted run's bit for
bit; a checkpoint cut short by a kill (no manifest) or damaged in the bucket is never resumed
from; pruning leaves the newest complete ones; credentials are never written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runner import run_group
from s3_server import SECRET, local_s3
from safetensors.torch import load
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Callback, Trainer
from glassloop.options import CheckpointConfig


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with local_s3("bucket") as env:
        yield env


SMALL = [
    "--set", "data.name=synthetic", "--set", "data.num_samples=320", "--set", "data.batch_size=32",
    "--set", "data.num_features=8", "--set", "model.hidden=[16]", "--set", "train.epochs=2",
    "--set", "checkpoint.every_n_steps=1", "--set", "checkpoint.keep_last=2",
    "--set", "train.progress=none",
]  # fmt: skip


def train(cwd: Path, env: dict[str, str], url: str, *extra: str) -> Any:
    cache = {"GLASSLOOP_CACHE_DIR": str(cwd / "cache")}
    return run_group(
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


def test_a_killed_s3_run_resumes_bitwise(tmp_path: Path, s3: dict[str, str]) -> None:
    """Uninterrupted vs killed after step 7 (uploads of the steps before in flight) and
    resumed with --resume in a new process: the same final weights, bit for bit, in the
    bucket; nothing named s3: in the working directory; no secret in any file written."""
    done = train(tmp_path, s3, "s3://bucket/straight")
    assert done.returncode == 0, done.stdout + done.stderr
    killed = train(tmp_path, s3, "s3://bucket/killed", "--kill-at-step", "7")
    assert killed.returncode != 0
    assert json.loads(s3_bytes("s3://bucket/killed/run.json"))["status"] == "running"
    resumed = train(tmp_path, s3, "s3://bucket/killed", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
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
    timing = ("seconds", "samples_per_s", "time", "elapsed_s")
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
    resumed = trainer(url, keep_last=3)
    resumed.fit(loader(), epochs=2, resume="auto")
    out = capsys.readouterr().out
    assert "step-00000005 did not verify after download" in out
    assert "at step 4 " in out
    straight = trainer("memory://bucket/straight")
    straight.fit(loader(), epochs=2)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert not fs.exists("/bucket/cut/checkpoints/step-00000006")  # pruned: incomplete


def test_a_fresh_run_never_overwrites_a_remote_run(cache: Path) -> None:
    url = "memory://bucket/taken"
    trainer(url).fit(loader(), epochs=1)
    with pytest.raises(Exception, match="already holds checkpoints"):
        trainer(url).fit(loader(), epochs=1)


def test_the_local_copy_is_never_a_folder_of_someone_else(cache: Path) -> None:
    """A folder where the local copy goes that glassloop did not make is refused, untouched."""
    from glassloop.remote import RemoteRun

    remote = RemoteRun("memory://bucket/mine")
    remote.container.mkdir(parents=True)
    (remote.container / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="is not glassloop's"):
        trainer("memory://bucket/mine").fit(loader(), epochs=1)
    assert (remote.container / "notes.txt").read_text() == "mine"
