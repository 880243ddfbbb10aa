"""A CLI run directory works from any folder (issue 32.6): its relative paths (a file
``model.target``, ``data.path``) are read from the current folder, else from the one the run
was started in (``cwd`` in run.json); one that neither has is one line naming the key, the
path and both folders (exit 2), and the run's files stay as they were."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forkserver
import numpy as np
import pytest
from cli_runner import run_glassloop, sets

import glassloop

NET = """from torch import nn

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.layers(x)
"""
OPTIONS = [
    "model.target=net.py:Net", "data.name=npz", "data.path=digits.npz", "train.epochs=1",
    "train.progress=none", "checkpoint.every_n_steps=2", "train.limit_batches=3",
]  # fmt: skip


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """A run trained in a new process in ``a/`` (its model and data named relative to ``a/``;
    forked: tests/forkserver.py), and another folder ``b/``."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "net.py").write_text(NET, encoding="utf-8")
    rng = np.random.default_rng(0)
    np.savez(a / "digits.npz", x=rng.random((96, 8, 8), dtype=np.float32), y=np.arange(96) % 10)
    trained = forkserver.run(
        [sys.executable, "-m", "glassloop", "train", *sets(OPTIONS), "--run-dir", "runs/x"],
        cwd=a,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    return a, b


def test_eval_report_predict_and_resume_work_from_another_folder(
    folders: tuple[Path, Path],
) -> None:
    a, b = folders
    run = a / "runs" / "x"
    np.save(b / "one.npy", np.zeros((8, 8), dtype=np.float32))
    for args in (
        ["eval", str(run), "--trust-code"],
        ["eval", str(sorted((run / "checkpoints").glob("step-*"))[0]), "--trust-code"],
        ["report", str(run), "--trust-code"],
        ["predict", str(run), "one.npy", "--trust-code"],
    ):
        done = run_glassloop(*args, cwd=b)
        assert done.returncode == 0, (args, done.stderr)
    with pytest.MonkeyPatch.context() as patch:  # (Python finds the file as the CLI does)
        patch.chdir(b)
        assert (
            type(glassloop.load_model(run / "model.safetensors", trust_code=True)).__name__ == "Net"
        )
        with pytest.raises(
            glassloop.CheckpointError, match=r"^checkpoint: 'nope.safetensors' not found"
        ):
            glassloop.load_model("nope.safetensors")
    # A resume in a new process, from b/: the same config (no "config changed"), and its
    # run.json still names a/, where the paths point.
    resumed = forkserver.run(
        [sys.executable, "-m", "glassloop", "train", str(run / "config.json"), "--trust-code", "--run-dir",
         str(run), "--resume", "--set", "train.epochs=2"],
        cwd=b, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    assert json.loads((run / "run.json").read_text())["cwd"] == str(a.resolve())
    recorded = json.loads((run / "config.json").read_text())  # paths as written, not found
    assert (recorded["model"]["target"], recorded["data"]["path"]) == ("net.py:Net", "digits.npz")
    assert run_glassloop("eval", str(run), "--trust-code", cwd=b).returncode == 0


@pytest.mark.parametrize(("gone", "key"), [("net.py", "model.target"), ("digits.npz", "data.path")])
def test_a_file_in_neither_folder_is_one_line(
    folders: tuple[Path, Path], gone: str, key: str
) -> None:
    a, b = folders
    run = a / "runs" / "x"
    (a / gone).unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for args in (
        ["eval", str(run), "--trust-code"],
        ["report", str(run), "--trust-code"],
        ["train", str(run / "config.json"), "--run-dir", str(run), "--resume", "--trust-code"],
        *([["predict", str(run), "x.npy", "--trust-code"]] if key == "model.target" else []),
    ):
        done = run_glassloop(*args, cwd=b)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args, done.stderr)
        assert f"{key} '{gone}' is neither in the current folder ('{b}')" in done.stderr
        assert f"the one the run was started in ('{a.resolve()}')" in done.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
