"""A model with frozen parameters (a frozen encoder; peft's base: tests/integration/
test_fine_tuning.py) checkpoints only what trains, plus the SHA-256 of what does not; a
resume refuses a base that differs, naming the first tensor, and is bitwise as before.

A kill is a ``BaseException`` raised inside a training forward (as test_resume_edges.py);
the resume is a fresh model and Trainer, as a new process builds them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import glassloop
from glassloop import Callback, CheckpointError, Trainer
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.storage.frozen_base import FrozenBase, tensor_digest
from glassloop.storage.weights import load_checked


class Kill(BaseException):
    """Stands in for kill -9."""


class Encoded(nn.Module):
    """A pretrained-looking encoder (frozen) under a trained head, with dropout."""

    def __init__(self, kill_at: int = 0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))
        self.norm = nn.BatchNorm1d(64)  # trains: its running statistics are buffers
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, 3))
        self.calls, self.kill_at = 0, kill_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.kill_at:
                raise Kill
        out: torch.Tensor = self.head(self.norm(self.encoder(x)))
        return out


def build(kill_at: int = 0, base_seed: int = 0) -> Encoded:
    torch.manual_seed(base_seed)  # "from_pretrained": the same base every time
    model = Encoded(kill_at)
    torch.manual_seed(1)
    model.head[1].reset_parameters()
    model.encoder.requires_grad_(False)
    return model


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    return DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(4))


def trainer(model: nn.Module, run_dir: Path, **checkpoint: Any) -> Trainer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Trainer(
        model,
        torch.optim.AdamW(trainable, lr=1e-2),
        nn.CrossEntropyLoss(),
        run_dir=run_dir,
        checkpoint=CheckpointConfig(every_n_steps=4, keep_last=10, **checkpoint),
        progress="none",
        seed=5,
    )


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


def test_a_checkpoint_holds_what_trains_and_the_base_digests(tmp_path: Path) -> None:
    model = build()
    trainer(model, tmp_path / "run").fit(loader(), epochs=1)
    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    stored = load_file(step / "model.safetensors")
    frozen = {"encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"}
    assert frozen.isdisjoint(stored)  # the base stays out...
    assert {"head.1.weight", "norm.weight", "norm.running_mean"} <= set(stored)  # ...the rest in
    base = json.loads((step / "meta.json").read_text())["base"]
    assert base["tensors"] == {
        name: tensor_digest(model.state_dict()[name]) for name in sorted(frozen)
    }
    # The final weights of a model that is not a peft adapter: whole (checkpoint.final_weights)
    assert frozen <= set(weights(tmp_path / "run"))


def test_a_killed_fine_tuning_resumes_bitwise_on_a_rebuilt_base(tmp_path: Path) -> None:
    trainer(build(), tmp_path / "straight").fit(loader(), epochs=2)
    with pytest.raises(Kill):
        trainer(build(kill_at=9), tmp_path / "cut").fit(loader(), epochs=2)
    trainer(build(), tmp_path / "cut").fit(loader(), epochs=2, resume="auto")
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_on_another_base_is_one_line_naming_the_first_tensor(tmp_path: Path) -> None:
    with pytest.raises(Kill):
        trainer(build(kill_at=6), tmp_path / "run").fit(loader(), epochs=2)
    other = build()
    with torch.no_grad():
        other.encoder[2].bias[5] += 1e-6  # one element of the last frozen tensors
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        trainer(other, tmp_path / "run").fit(loader(), epochs=2, resume="auto")
    assert str(caught.value) == (
        f"checkpoint: '{tmp_path / 'run' / 'checkpoints' / 'step-00000004'}' was trained on "
        "another base: 'encoder.2.bias' differs (SHA-256 "
        f"{tensor_digest(build().encoder[2].bias)[:12]}... expected); load the base the run "
        "was trained on (the same pretrained weights, or the same seed), or start a new run"
    )
    after = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing loaded


class Unfreeze(Callback):
    """Unfreezes the encoder's last layer after the first epoch (a common schedule)."""

    def on_epoch_end(self, trainer: Any, row: dict[str, Any]) -> None:
        model = trainer.model
        if model.encoder[2].weight.requires_grad:
            return
        model.encoder[2].requires_grad_(True)
        trainer.optimizer.add_param_group({"params": list(model.encoder[2].parameters())})


def test_a_layer_unfrozen_during_the_run_is_saved_from_then_on(tmp_path: Path) -> None:
    model = build()
    fit = trainer(model, tmp_path / "run")
    fit.callbacks.append(Unfreeze())
    fit.fit(loader(), epochs=2)
    first = load_file(tmp_path / "run" / "checkpoints" / "step-00000004" / "model.safetensors")
    last = load_file(tmp_path / "run" / "checkpoints" / "step-00000012" / "model.safetensors")
    assert "encoder.2.weight" not in first and "encoder.2.weight" in last
    assert "encoder.0.weight" not in last
    # A rebuilt model (all of the encoder frozen, as at the start) takes the unfrozen layer
    # from the checkpoint and the rest from its base.
    again = build()
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000012")
    base = FrozenBase().check(again, ckpt.meta["base"], set(ckpt.model_tensors), ckpt.path)
    assert base == {"encoder.0.weight", "encoder.0.bias"}
    load_checked(again, ckpt.model_tensors, ckpt.path, base)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 model.state_dict().values(), strict=True))  # fmt: skip


def test_save_frozen_keeps_every_tensor_and_final_trainable_leaves_the_base_out(
    tmp_path: Path,
) -> None:
    trainer(build(), tmp_path / "full", save_frozen=True).fit(loader(), epochs=1)
    step = tmp_path / "full" / "checkpoints" / "step-00000004"
    assert "encoder.0.weight" in load_file(step / "model.safetensors")
    assert "base" not in json.loads((step / "meta.json").read_text())

    model = build()
    trainer(model, tmp_path / "adapter", final_weights="trainable").fit(loader(), epochs=1)
    final = tmp_path / "adapter" / "model.safetensors"
    assert "encoder.0.weight" not in weights(tmp_path / "adapter")
    # glassloop.load_weights puts them onto the base they were trained on, and only that one
    fresh = build()
    glassloop.load_weights(fresh, final)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values(), strict=True))  # fmt: skip
    other = build(base_seed=9)
    with pytest.raises(CheckpointError, match=r"'encoder\.0\.weight' differs"):
        glassloop.load_weights(other, final)


class Teacher(nn.Module):
    """A student and a frozen teacher the run moves towards it in place through ``.data`` at
    each step (DINO's, MoCo's way: no version bump, no gradient), and a trained layer that
    a callback freezes after epoch 1: neither is the base, both must be saved."""

    def __init__(self, kill_at: int = 0) -> None:
        super().__init__()
        self.student = nn.Linear(8, 3)
        self.teacher = nn.Linear(8, 3).requires_grad_(False)
        self.calls, self.kill_at = 0, kill_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.kill_at:
                raise Kill
            for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                t.data.mul_(0.9).add_(0.1 * s.data)
        out: torch.Tensor = self.student(x) + 0.1 * self.teacher(x)
        return out


class FreezeStudentBias(Callback):
    """Freezes the student's bias from epoch 2 on (again in a run resumed after that)."""

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.state.epoch >= 1:
            trainer.model.student.bias.requires_grad_(False)

    def on_epoch_end(self, trainer: Any, row: dict[str, Any]) -> None:
        trainer.model.student.bias.requires_grad_(False)


def test_frozen_tensors_the_run_changes_are_saved_and_resume_bitwise(tmp_path: Path) -> None:
    def run(kill_at: int, where: str, resume: str | None = None) -> Trainer:
        torch.manual_seed(0)
        model = Teacher(kill_at)
        fit = trainer(model, tmp_path / where)
        fit.callbacks.append(FreezeStudentBias())
        fit.fit(loader(), epochs=3, resume=resume)
        return fit

    straight = run(0, "straight")
    with pytest.raises(Kill):
        run(15, "cut")  # in epoch 3: the teacher moved, the student's bias frozen after training
    stored = load_file(tmp_path / "cut" / "checkpoints" / "step-00000012" / "model.safetensors")
    assert {"teacher.weight", "teacher.bias", "student.bias"} <= set(stored)
    resumed = run(0, "cut", resume="auto")
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_from_before_a_stateful_part_existed_resumes() -> None:
    """A part added to Trainer.stateful() (micro_batches) is absent from older checkpoints:
    they resume, the part starting fresh (it was KeyError: 'micro_batches')."""
    fit = Trainer(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                  nn.MSELoss(), progress="none", micro_batch_size="auto")  # fmt: skip
    fit.checkpointer.attach(fit.stateful())
    state = fit.checkpointer.state_dict()
    del state["micro_batches"]
    fit.checkpointer.load_state_dict(state)
    assert fit.micro_batches.rows is None
