"""The checkpoint stores' guarantees (glassloop.run_dir.store), one test each, run against
every backend: the local run directory and an fsspec store (fsspec's own local filesystem
driver, ``file://``, so links and damage can be made in it; the S3 server's runs are in
test_remote_run.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import forkserver
import fsspec
import pytest
import torch
from torch import nn

from glassloop.errors import CheckpointError
from glassloop.run_dir.checkpoints import stage_checkpoint, step_dir_name, verify_files
from glassloop.run_dir.fsspec_store import FsspecStore
from glassloop.run_dir.layout import BEST, MANIFEST, WEIGHTS
from glassloop.run_dir.local_store import LocalStore
from glassloop.run_dir.store import CheckpointStore
from glassloop.storage.atomic import ForeignPathError
from glassloop.storage.snapshot import snapshot

BACKENDS = ["local", "fsspec"]


def make_store(kind: str, root: Path) -> CheckpointStore:
    if kind == "local":
        return LocalStore(root / "run")
    fs = fsspec.filesystem("file")
    return FsspecStore(fs, str(root / "bucket"), root / "copy", shown=f"file://{root}/bucket")


def stored_file(store: Any, name: str, file: str) -> Path:
    """Where the store keeps ``file`` of ``name`` (both backends are on this disk here)."""
    if isinstance(store, LocalStore):
        return store.path(name) / file
    return Path(store.where(name)) / file


def staged(store: Any, tmp: Path, step: int, size: int = 16) -> Path:
    """A complete checkpoint of ``step`` ready for ``store.write``: the local store's
    staging folder beside its place, or a committed local checkpoint an upload copies."""
    model = nn.Linear(size, size)
    torch.nn.init.constant_(model.weight, float(step))
    snap = snapshot(model, {"w": torch.full((3,), float(step))}, {"step": step})
    if isinstance(store, LocalStore):
        target = store.path(step_dir_name(step))
        target.parent.mkdir(parents=True, exist_ok=True)
        return stage_checkpoint(target, snap)
    return LocalStore(tmp / f"source-{step}").commit(snap)


def written(store: Any, tmp: Path, *steps: int) -> None:
    for step in steps:
        store.write(step_dir_name(step), staged(store, tmp, step))


@pytest.mark.parametrize("kind", BACKENDS)
def test_written_is_complete_and_reads_back_verified(tmp_path: Path, kind: str) -> None:
    store = make_store(kind, tmp_path)
    assert store.complete() == []
    written(store, tmp_path, 1, 2)
    assert store.complete() == ["step-00000001", "step-00000002"]
    folder = store.read("step-00000002")
    assert verify_files(folder) is False  # (not sharded) every file as its manifest says
    weights = (folder / WEIGHTS).read_bytes()
    assert weights == stored_file(store, "step-00000002", WEIGHTS).read_bytes()
    store.write(BEST, staged(store, tmp_path, 3))  # best/ is not a step: not listed
    assert store.complete() == ["step-00000001", "step-00000002"]
    assert verify_files(store.read(BEST)) is False


@pytest.mark.parametrize("kind", BACKENDS)
def test_without_its_manifest_a_checkpoint_is_not_complete(tmp_path: Path, kind: str) -> None:
    """What a write cut before its manifest leaves (every object there, the manifest not)."""
    store = make_store(kind, tmp_path)
    written(store, tmp_path, 1, 2)
    stored_file(store, "step-00000002", MANIFEST).unlink()
    assert store.complete() == ["step-00000001"]
    with pytest.raises(CheckpointError):
        store.read("step-00000002")


@pytest.mark.parametrize("kind", BACKENDS)
def test_damage_and_a_missing_file_fail_the_read(tmp_path: Path, kind: str) -> None:
    store = make_store(kind, tmp_path)
    written(store, tmp_path, 1, 2)
    damaged = stored_file(store, "step-00000002", WEIGHTS)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern of the last tensor's bytes
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        store.read("step-00000002")
    stored_file(store, "step-00000001", "state.json").unlink()
    with pytest.raises(CheckpointError, match=r"state\.json"):
        store.read("step-00000001")


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_link_in_a_checkpoints_place_is_never_written_or_read_through(
    tmp_path: Path, kind: str
) -> None:
    store = make_store(kind, tmp_path)
    written(store, tmp_path, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("mine")
    place = stored_file(store, "step-00000002", WEIGHTS).parent
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ForeignPathError, match="symbolic link"):
        store.write("step-00000002", staged(store, tmp_path, 2))
    with pytest.raises(ForeignPathError, match="symbolic link"):
        store.read("step-00000002")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["mine.txt"]
    assert store.complete() == ["step-00000001"]


@pytest.mark.parametrize("kind", BACKENDS)
def test_remove_takes_one_checkpoint_and_pruning_keeps_the_newest(
    tmp_path: Path, kind: str
) -> None:
    store = make_store(kind, tmp_path)
    written(store, tmp_path, 1, 2, 3)
    store.remove("step-00000001")
    assert store.complete() == ["step-00000002", "step-00000003"]
    assert verify_files(store.read("step-00000003")) is False


WRITER = """
import sys, torch
from pathlib import Path
from torch import nn
sys.path[:0] = [{tests!r}, {helpers!r}]
from test_stores import make_store, staged
from glassloop.run_dir.checkpoints import step_dir_name
store, tmp = make_store({kind!r}, Path({root!r})), Path({root!r})
for step in range(1, 10_000):
    store.write(step_dir_name(step), staged(store, tmp, step, size=700))
    print(step, flush=True)
"""


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_kill_at_any_moment_of_a_write_leaves_every_complete_checkpoint_whole(
    tmp_path: Path, kind: str
) -> None:
    """A writer in a process of its own, killed with SIGKILL at three moments of its writes
    (2 MB of weights each): what the store then calls complete reads back verified, and the
    checkpoint the writer finished last before the kill is among them."""
    here = Path(__file__).parent
    script = WRITER.format(tests=str(here), helpers=str(here.parent), kind=kind, root=str(tmp_path))
    (tmp_path / "writer.py").write_text(script)
    for delay in (0.0, 0.013, 0.029):
        # (a new process, forked: tests/forkserver.py)
        writer = forkserver.Popen([sys.executable, str(tmp_path / "writer.py")])
        assert writer.stdout is not None
        finished = [int(writer.stdout.readline()) for _ in range(2)][-1]
        time.sleep(delay)
        os.kill(writer.pid, signal.SIGKILL)
        writer.communicate()
        assert writer.returncode == -signal.SIGKILL
        store = make_store(kind, tmp_path)
        names = store.complete()
        assert step_dir_name(finished) in names or any(n > step_dir_name(finished) for n in names)
        for name in names:
            assert verify_files(store.read(name)) is False
