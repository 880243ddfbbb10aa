"""Checkpoints written in the background (``checkpoint.async_save``): what is saved is the state
at the save, never what training changed after it; a failed background save stops the run at
the next step row or save with its own message and never leaves a half-visible checkpoint;
``verify-resume`` (kill -9, resume in a new process) is exact with it on. (The every-number
matrix runs with it too: tests/loop/test_every_number.py.)"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from cli_runner import run_glassloop
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Callback, Trainer
from glassloop.checkpoint.checkpointer import Checkpointer
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import latest_pointer, read_checkpoint
from glassloop.state import TrainState
from glassloop.storage.atomic import ForeignPathError
from glassloop.storage.snapshot import HostCopy
from glassloop.tools import verify_resume


def test_the_copy_is_the_state_at_the_save(tmp_path: Path) -> None:
    """The step goes on while the write does: the checkpoint holds the weights and optimizer
    state of the moment ``save()`` was called, not those changed in place after it."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(
        tmp_path, CheckpointConfig(async_save=True, keep_last=5), model=model
    )
    checkpointer.attach({"loop": TrainState(), "optimizer": optimizer})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state[model.weight]["exp_avg"].clone()
    checkpointer.state.step = 1
    path = checkpointer.save()
    with torch.no_grad():  # what the next steps do, while the save may be in flight
        model.weight.add_(1.0)
        optimizer.state[model.weight]["exp_avg"].mul_(3.0)
    checkpointer.wait()
    assert path is not None
    saved = read_checkpoint(path)
    for key, value in weights.items():
        assert torch.equal(saved.model_tensors[key], value), key
    assert torch.equal(saved.state["optimizer"]["state"][0]["exp_avg"], moments)
    # The next save reuses the host buffers: it must hold the new values, the first intact.
    checkpointer.state.step = 2
    second = checkpointer.save(wait=True)
    assert second is not None
    assert torch.equal(read_checkpoint(second).model_tensors["weight"], model.weight.detach())
    assert torch.equal(read_checkpoint(path).model_tensors["weight"], weights["weight"])
    assert checkpointer.times.summary() is not None


class LinkAt(Callback):
    """Puts a link where step 3's checkpoint goes, once step 2 is done (the run checks its
    directory for links when it starts: this one appears during the run)."""

    def __init__(self, link: Path, target: Path) -> None:
        self.link, self.target = link, target

    def on_step_end(self, trainer: Any, step: int, loss: Any) -> None:
        if step == 2:  # (step 1's save may still be in flight: its folder made here)
            self.link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(self.target, self.link)


def trainer(run_dir: Path, *callbacks: Callback) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        log_every=1,
        run_dir=run_dir,
        checkpoint=CheckpointConfig(every_n_steps=1, keep_last=10, async_save=True),
        callbacks=callbacks,
    )


def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    return DataLoader(data, batch_size=8)


def test_a_failed_background_save_stops_the_run_and_loses_nothing(tmp_path: Path) -> None:
    """A link where step 3's checkpoint goes: the background commit refuses it; the run stops
    at the next step row or save with that line; step 2's checkpoint is the latest, intact;
    the link and what it points to are untouched; nothing half-written is left visible."""
    run = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    link = LinkAt(run / "checkpoints" / "step-00000003", outside)
    with pytest.raises(ForeignPathError, match="step-00000003"):
        trainer(run, link).fit(loader(), epochs=1)
    assert latest_pointer(run) == run / "checkpoints" / "step-00000002"
    assert read_checkpoint(run / "checkpoints" / "step-00000002").step == 2
    assert (outside / "keep.txt").read_text() == "mine"
    assert os.path.islink(run / "checkpoints" / "step-00000003")
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert not (run / "checkpoints" / "step-00000004").exists()
    # The link removed, the run resumes from step 2 and finishes.
    os.unlink(run / "checkpoints" / "step-00000003")
    resumed = trainer(run)
    resumed.fit(loader(), epochs=1, resume="auto")
    assert resumed.state.step == 8


SMALL = [
    "--set", "data.name=synthetic", "--set", "data.num_samples=320", "--set", "data.batch_size=32",
    "--set", "data.num_features=8", "--set", "model.hidden=[16]", "--set", "train.epochs=1",
    "--set", "checkpoint.every_n_steps=1", "--set", "train.progress=none",
    "--set", "checkpoint.async_save=true",
]  # fmt: skip


def test_verify_resume_is_exact_with_background_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 after step 5 (a save may be in flight), resume in a new process: every digest
    identical to the straight run's."""
    forkserver.start_children_here(monkeypatch, verify_resume)  # (its runs forked)
    done = run_glassloop("verify-resume", *SMALL, "--kill-at", "5", "--keep", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resume is exact" in done.stdout
    assert "checkpoints:" in done.stdout or (tmp_path / "straight" / "run.json").is_file()
    run_json = (tmp_path / "straight" / "run.json").read_text()
    assert '"checkpoints"' in run_json and '"gb_per_s"' in run_json


def test_each_epoch_row_says_how_long_its_steps_waited_for_checkpoints(tmp_path: Path) -> None:
    """checkpoint_s in every epoch row (history, metrics.csv, metrics.jsonl) of a run that
    saves: the seconds its steps were held by saves since the previous row; none without a
    run directory."""
    import csv
    import json

    run = trainer(tmp_path / "run")
    history = run.fit(loader(), epochs=2)
    assert all(row["checkpoint_s"] > 0 for row in history)  # (8 saves an epoch)
    with (tmp_path / "run" / "metrics.csv").open() as handle:
        epochs = [row for row in csv.DictReader(handle) if row["kind"] == "epoch"]
    assert [float(row["checkpoint_s"]) for row in epochs] == [
        pytest.approx(row["checkpoint_s"], rel=1e-5) for row in history
    ]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [row["checkpoint_s"] for row in rows if row["kind"] == "epoch"] == [
        row["checkpoint_s"] for row in history
    ]
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    plain = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    assert "checkpoint_s" not in plain.fit(loader(), epochs=1)[0]


class Perturbing(Trainer):
    """A step of its own that changes the weights before the optimizer's (SAM's ascent):
    its background saves copy everything before save() returns."""

    def train_step(self, window: Any) -> Any:
        self.forward_backward(window)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.5)  # (SAM: the gradient is taken here, then the weights put back)
        self.optimizer.zero_grad()
        loss = self.forward_backward(window)
        with torch.no_grad():
            for p in self.model.parameters():
                p.sub_(0.5)
        return loss if self.step(self.optimizer, loss) else None


@pytest.mark.parametrize(("norm", "kind"), [(False, Trainer), (True, Trainer), (False, Perturbing)])
def test_a_background_save_holds_what_a_sync_save_holds(
    tmp_path: Path, norm: bool, kind: type[Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run by the Trainer, a background save copies the parameters and the optimizer's state
    while the next step's forward and backward run, and that step's optimizer step waits for
    the copy: every checkpoint's tensors are bitwise those of the synchronous save of the
    same step (batch norm's buffers, which the forward changes, are copied before save()
    returns). The writer is made to copy as late as it may: once an optimizer step has
    ended, or after 0.2 s if none can end before the copy (as it must not)."""
    stepped = threading.Event()  # an optimizer step ended since the save began
    begin, copy_later = HostCopy.begin, HostCopy.copy_later

    def save_begins(self: HostCopy, later: set[int] | None = None) -> None:
        stepped.clear()
        begin(self, later)

    def late(self: HostCopy) -> None:
        stepped.wait(0.2)
        copy_later(self)

    monkeypatch.setattr(HostCopy, "begin", save_begins)
    monkeypatch.setattr(HostCopy, "copy_later", late)
    hook = register_optimizer_step_post_hook(lambda *_: stepped.set())
    files: dict[bool, dict[str, bytes]] = {}
    for async_save in (False, True):
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)]
        model = nn.Sequential(*([nn.BatchNorm1d(8)] if norm else []), *layers)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
        )
        run_dir = tmp_path / f"async-{async_save}"
        trainer = kind(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            nn.CrossEntropyLoss(),
            device="cpu",
            progress="none",
            run_dir=run_dir,
            checkpoint=CheckpointConfig(every_n_steps=2, keep_last=0, async_save=async_save),
        )
        trainer.fit(DataLoader(data, batch_size=16), epochs=2)
        # (the fit's end takes its hook off the optimizer: reused by another Trainer, it
        # keeps nothing of this one alive, its host copy included)
        assert not trainer.optimizer._optimizer_step_pre_hooks
        files[async_save] = {
            f"{p.parent.name}/{p.name}": p.read_bytes()
            for p in sorted((run_dir / "checkpoints").glob("step-*/*.safetensors"))
        }
    hook.remove()
    assert len(files[True]) == 2 * 6 and files[True] == files[False]
