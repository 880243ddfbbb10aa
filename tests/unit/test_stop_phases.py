"""A stop signal lands a checkpoint whatever the loop is doing (issue 35, item 1): inside a
validation (at an epoch's end or mid-epoch) the validation is abandoned within one batch, its
partial numbers never reported, and the resumed run validates again; a wait for data is cut
short. Real signals to this process (``os.kill``); the resume is a fresh ``Trainer`` with
fresh loaders, as a new process builds them (the new-process chain: test_preemption.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from glassloop import Preempted, Trainer
from glassloop.checkpoint import read_checkpoint
from glassloop.checkpointer import CheckpointConfig
from glassloop.data import make_loader
from glassloop.throughput import TIMING


class Net(nn.Module):
    """An MLP with dropout that sends itself ``sig`` at evaluation forward ``at`` (counted
    over the whole fit), the way a scheduler's signal lands in the middle of a validation."""

    def __init__(self, at: int = 0, sig: int = signal.SIGUSR1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.evals, self.at, self.sig = 0, at, sig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.evals += 1
            if self.evals == self.at:
                os.kill(os.getpid(), self.sig)
        out: torch.Tensor = self.net(x)
        return out


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def loaders(kind: str) -> tuple[Any, Any]:
    """Training and validation loaders as a new process builds them. ``"dataloader"``: the
    user's own, shuffling from the global RNG (a validation ``DataLoader`` draws its workers'
    seed from it too, even unshuffled: an abandoned validation must not shift it)."""
    if kind == "dataloader":
        train: Any = DataLoader(data(96, 1), batch_size=8, shuffle=True)
    else:
        tensors = data(96, 1).tensors
        train = make_loader(tensors, batch_size=8, shuffle=True, seed=3)
    return train, DataLoader(data(40, 2), batch_size=8)


def make(run_dir: Path, at: int = 0, **options: Any) -> Trainer:
    torch.manual_seed(0)
    model = Net(at)
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        nn.CrossEntropyLoss(),
        run_dir=run_dir,
        checkpoint=CheckpointConfig(every_n_steps=5),
        progress="none",
        **options,
    )


def rows(run: Path) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in found:
        for key in TIMING:
            row.pop(key, None)
    return found


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(
    ("kind", "every", "at", "due"),
    [
        ("dataloader", 0, 7, "epoch"),  # epoch 1's validation (5 batches), its 2nd batch
        ("glassloop", 0, 7, "epoch"),
        ("dataloader", 4, 7, "step"),  # the second mid-epoch validation (step 8)
        ("glassloop", 4, 17, "epoch"),  # epoch 1's end, after step 12's mid-epoch one
    ],
)
def test_a_stop_signal_inside_a_validation_abandons_it_and_the_resume_runs_it_again(
    tmp_path: Path, kind: str, every: int, at: int, due: str
) -> None:
    options = {"validate_every_n_steps": every}
    straight = make(tmp_path / "straight", **options)
    straight.fit(*loaders(kind), epochs=2)

    run = tmp_path / "stopped"
    stopped = make(run, at=at, **options)
    with pytest.raises(Preempted) as caught:
        stopped.fit(*loaders(kind), epochs=2)
    assert caught.value.exit_code == 128 + signal.SIGUSR1
    step = caught.value.step
    # Abandoned within one batch: the forward the signal came in finished, no other.
    assert stopped.model.evals == at
    # The checkpoint is the last completed step's and says a validation is owed.
    saved = read_checkpoint(run / "checkpoints" / f"step-{step:08d}")
    assert saved.state["loop"]["validation_due"] == due
    # No partial numbers: every row written before the stop is the straight run's.
    before = rows(run)
    assert before == rows(tmp_path / "straight")[: len(before)]
    abandoned = "val" if due == "step" else "epoch"
    assert not [r for r in before if r["kind"] == abandoned and r["step"] == step]

    resumed = make(run, **options)
    resumed.fit(*loaders(kind), epochs=2, resume="auto")
    assert rows(run) == rows(tmp_path / "straight")
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name


class SlowItem(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose item ``slow`` takes ``seconds`` (a network read, a cold cache)."""

    def __init__(self, slow: int = -1, seconds: float = 0.0) -> None:
        self.data, self.slow, self.seconds = data(96, 1), slow, seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.slow:
            time.sleep(self.seconds)
        return self.data[i]  # type: ignore[no-any-return]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stop_signal_during_a_long_wait_for_data_stops_at_once(
    tmp_path: Path, workers: int
) -> None:
    """The 60 s item is never waited for: the stop takes well under a second, the checkpoint
    is the last completed step's (two micro-batches per step: the half-gathered one dropped),
    and the resume equals the straight run."""

    order = [int(i) for i in torch.randperm(96, generator=torch.Generator().manual_seed(5))]

    def loader(slow: int = -1) -> DataLoader[Any]:
        dataset = SlowItem(slow, 60.0)
        return DataLoader(dataset, batch_size=4, sampler=order, num_workers=workers)

    slow = order[4 * 8 + 4 * 1]  # in batch 9 (the 2nd micro-batch of step 5)
    options = {"grad_accum_steps": 2}
    straight = make(tmp_path / "straight", **options)
    straight.fit(loader(), epochs=1)

    run = tmp_path / "stopped"
    stopped = make(run, **options)
    timer = threading.Timer(2.0 + workers, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    began = time.perf_counter()
    with pytest.raises(Preempted) as caught:
        stopped.fit(loader(slow), epochs=1)
    timer.cancel()
    assert time.perf_counter() - began < 30  # not the 60 s item
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert caught.value.step == 4  # batch 9 is step 5's: its first micro-batch dropped
    resumed = make(run, **options)
    resumed.fit(loader(), epochs=1, resume="auto")
    assert rows(run) == rows(tmp_path / "straight")
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name
