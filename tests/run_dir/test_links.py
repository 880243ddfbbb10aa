"""Never touch what is not ours: a symbolic link where glassloop keeps its own file or folder
is never written through, replaced or deleted, by any command or library call. Each test
links a victim (a folder with files, or a file) in as a name glassloop writes or deletes and
checks that the victim is byte-identical afterwards (contents, names, modification times)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop, sets

from glassloop.run_dir.checkpoints import (
    MARKER,
    clean_temporaries,
    remove_marked,
)
from glassloop.run_dir.local_store import LocalStore
from glassloop.run_dir.lock import RunLock
from glassloop.storage.atomic import ForeignPathError, atomic_path, open_own, remove_tree
from glassloop.storage.snapshot import snapshot as snapshot_of

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_links")

SMALL = [
    "data.name=synthetic", "data.num_samples=256", "data.num_features=8", "model.hidden=[16]",
    "train.progress=none", "checkpoint.keep_last=1", "checkpoint.monitor=val_loss",
    "train.tensorboard=true",
]  # fmt: skip


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every name under ``path`` (itself included) with its bytes and modification time."""
    found = {}
    for item in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        data = item.read_bytes() if item.is_file() else b"<dir>"
        found[str(item.relative_to(path.parent))] = (data, item.stat().st_mtime_ns)
    return found


@pytest.fixture
def victims(tmp_path: Path) -> dict[str, Path]:
    """A folder with two files and a subfolder, and a lone file, outside any run."""
    folder = tmp_path / "victim-dir"
    (folder / "inner").mkdir(parents=True)
    (folder / "a.txt").write_text("precious a")
    (folder / "inner" / "b.txt").write_text("precious b")
    single = tmp_path / "victim-file"
    single.write_text("precious file")
    return {"dir": folder, "file": single}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that trained one epoch (checkpoint step-00000004, best/, report/, tensorboard/)."""
    run = tmp_path_factory.mktemp("links") / "run"
    done = run_glassloop("train", *sets([*SMALL, "train.epochs=1"]), "--run-dir", str(run))
    assert done.returncode == 0, done.stderr
    assert (run / "checkpoints" / "step-00000004").is_dir() and (run / "best").is_dir()
    return run


def plant(link: Path, target: Path) -> None:
    """Put a symbolic link to ``target`` where ``link`` is (whatever was there goes)."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    elif os.path.lexists(link):
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


OWN_NAMES = [
    ".lock", "config.json", "run.json", "metrics.csv", "metrics.jsonl", "model.safetensors",
    "tracking.json", "checkpoints", "best", "report", "tensorboard", "wandb",
    "checkpoints/latest", "checkpoints/step-00000004", "checkpoints/step-00000008",
    "report/index.html", "report/loss.png", "profile", "profile/trace.json",
]  # fmt: skip


@pytest.mark.parametrize("kind", ["dir", "file"])
@pytest.mark.parametrize("name", OWN_NAMES)
def test_a_link_where_glassloop_writes_stops_the_resume_and_touches_nothing(
    tmp_path: Path, template: Path, victims: dict[str, Path], name: str, kind: str
) -> None:
    run = tmp_path / "run"
    shutil.copytree(template, run, symlinks=True)
    victim = victims[kind]
    before = snapshot(victim)
    plant(run / name, victim)
    run_before = snapshot(run)
    done = run_glassloop(
        "train", *sets([*SMALL, "train.epochs=2"]), "--run-dir", str(run), "--resume"
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"'{run / name}'" in lines[0] and "symbolic link" in lines[0], lines[0]
    assert snapshot(victim) == before
    assert (run / name).is_symlink() and (run / name).resolve() == victim.resolve()
    assert snapshot(run) == run_before  # stopped before writing anything at all


def test_a_fresh_run_into_a_prepared_folder_with_links_stops_before_training(
    tmp_path: Path, victims: dict[str, Path]
) -> None:
    run = tmp_path / "run"
    before = snapshot(victims["dir"])
    plant(run / "best", victims["dir"])
    plant(run / "checkpoints" / "step-00000008", victims["dir"])
    done = run_glassloop("train", *sets([*SMALL, "train.epochs=2"]), "--run-dir", str(run))
    assert done.returncode == 2, done.stderr
    assert "are symbolic links" in done.stderr and "step-00000008" in done.stderr
    assert snapshot(victims["dir"]) == before
    assert not (run / "metrics.jsonl").exists()  # stopped before anything was written


# ----------------------------------------- the storage functions, when a link appears mid-run
def test_replacing_a_checkpoint_never_follows_a_link_in_its_place(
    tmp_path: Path, victims: dict[str, Path]
) -> None:
    """The reported bug: a checkpoint folder about to be re-saved is a link to a folder;
    the old code renamed the link aside and emptied its target, then said "nothing was
    lost"."""
    from torch import nn

    run = tmp_path / "run"
    model = nn.Linear(2, 2)
    state = {"loop": {"step": 4, "epoch": 1, "batch_in_epoch": 0, "samples_seen": 8}}
    meta = {"step": 4, "epoch": 1, "format": 1}
    before = snapshot(victims["dir"])
    plant(run / "checkpoints" / "step-00000004", victims["dir"])
    with pytest.raises(ForeignPathError, match="is a symbolic link"):
        LocalStore(run).commit(snapshot_of(model, state, meta))
    plant(run / "best", victims["dir"])
    with pytest.raises(ForeignPathError, match="is a symbolic link"):
        LocalStore(run).commit(snapshot_of(model, state, meta), best=True)
    assert snapshot(victims["dir"]) == before
    # Nothing was left behind by the refused writes either.
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    # A real folder of someone else's under a checkpoint's name is refused too.
    foreign = run / "checkpoints" / "step-00000006"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ForeignPathError, match="not a checkpoint glassloop wrote"):
        LocalStore(run).commit(snapshot_of(model, state, {**meta, "step": 6}))
    assert (foreign / "notes.txt").read_text() == "mine"


def test_deleting_never_follows_a_link(tmp_path: Path, victims: dict[str, Path]) -> None:
    before = {kind: snapshot(path) for kind, path in victims.items()}
    # A folder of ours that holds links to both: the links go, their targets stay.
    ours = tmp_path / ".tmp-step-00000001-1"
    (ours / "shards").mkdir(parents=True)
    (ours / MARKER).touch()
    (ours / "to-dir").symlink_to(victims["dir"])
    (ours / "to-file").symlink_to(victims["file"])
    (ours / "shards" / "to-dir").symlink_to(victims["dir"])
    remove_marked(ours)
    assert not os.path.lexists(ours)
    # A link in place of the folder itself is refused.
    link = tmp_path / "link"
    link.symlink_to(victims["dir"])
    for remove in (remove_marked, remove_tree):
        with pytest.raises(ForeignPathError):
            remove(link)
    # Start-up cleaning and pruning pass over links with glassloop's own names.
    run = tmp_path / "run"
    names = [
        ".tmp-step-00000001-7", ".old-step-00000002-7", ".trash-step-00000003-7",
        ".old-best-7", ".latest.tmp-7",
    ]  # fmt: skip
    for name in names:
        plant(run / "checkpoints" / name, victims["dir"])
        plant(run / name, victims["dir"] if "latest" not in name else victims["file"])
    clean_temporaries(run)
    LocalStore(run).prune(keep_last=1)
    assert all((run / "checkpoints" / n).is_symlink() and (run / n).is_symlink() for n in names)
    assert {kind: snapshot(path) for kind, path in victims.items()} == before


def test_file_writes_never_go_through_a_link(tmp_path: Path, victims: dict[str, Path]) -> None:
    before = snapshot(victims["file"])
    target = tmp_path / "out.json"
    plant(target, victims["file"])
    with pytest.raises(ForeignPathError), atomic_path(target) as tmp:
        tmp.write_text("x")
    # The temporary name itself planted as a link (this process's pid).
    plant(tmp_path / f".other.json.tmp-{os.getpid()}", victims["file"])
    with pytest.raises(ForeignPathError), atomic_path(tmp_path / "other.json") as tmp:
        tmp.write_text("x")
    with pytest.raises(ForeignPathError):
        open_own(target, "a", encoding="utf-8")
    plant(tmp_path / ".lock", victims["file"])
    with pytest.raises(ForeignPathError):
        RunLock(tmp_path).acquire()
    assert snapshot(victims["file"]) == before


# ----------------------------------------------------------- the other commands that write
def test_report_export_and_predict_never_write_through_a_link(
    tmp_path: Path, template: Path, victims: dict[str, Path]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(template, run, symlinks=True)
    before = {kind: snapshot(path) for kind, path in victims.items()}
    plant(run / "report", victims["dir"])
    done = run_glassloop("report", str(run))
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr
    plant(tmp_path / "model.safetensors", victims["file"])
    done = run_glassloop("export", str(run), "--output", str(tmp_path / "model.safetensors"))
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr
    rows = tmp_path / "rows.npy"
    np.save(rows, np.zeros((2, 8), dtype=np.float32))
    plant(tmp_path / "preds.csv", victims["file"])
    done = run_glassloop("predict", str(run), str(rows), "--output", str(tmp_path / "preds.csv"))
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr
    assert {kind: snapshot(path) for kind, path in victims.items()} == before


def test_the_data_cache_never_writes_through_a_link(
    tmp_path: Path, victims: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from glassloop.data.datasets import _cached

    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))
    before = snapshot(victims["file"])
    plant(tmp_path / "cache" / "arrays.npz", victims["file"])  # not an npz: "rebuilt"
    with pytest.raises(ForeignPathError):
        _cached("arrays.npz", ("x",), lambda: {"x": np.arange(3)})
    assert snapshot(victims["file"]) == before
    # Without the link the cache is written and read back as usual.
    (tmp_path / "cache" / "arrays.npz").unlink()
    made = _cached("arrays.npz", ("x",), lambda: {"x": np.arange(3)})
    again = _cached("arrays.npz", ("x",), lambda: {"x": np.zeros(3)})
    assert torch.equal(torch.from_numpy(made["x"]), torch.from_numpy(again["x"]))
