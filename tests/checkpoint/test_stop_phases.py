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

from glassloop import Callback, Preempted, Trainer
from glassloop.data import make_loader
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.step.throughput import TIMING


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
    seed from it too, even unshuffled: an abandoned validation must not shift it).
    ``"glassloop"``: glassloop's, and two validation sets (one a glassloop loader, which an
    abandoned validation must not leave in the middle of its set)."""
    if kind == "dataloader":
        train: Any = DataLoader(data(96, 1), batch_size=8, shuffle=True)
        return train, DataLoader(data(40, 2), batch_size=8)
    train = make_loader(data(96, 1).tensors, batch_size=8, shuffle=True, seed=3)
    sets = {
        "a": DataLoader(data(40, 2), batch_size=8),
        "b": make_loader(data(24, 4).tensors, batch_size=8),
    }
    return train, sets


class Counting(Callback):
    """Counts the validations it saw end (a callback with state: kept in checkpoints)."""

    def __init__(self) -> None:
        self.ended: list[float] = []

    def on_validation_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        self.ended.append(round(float(metrics["loss"]), 6))

    def state_dict(self) -> dict[str, Any]:
        return {"ended": list(self.ended)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ended = list(state["ended"])


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
        clip_grad_norm=1.0,  # (grad_norm in every row: a resume that takes no step keeps it)
        callbacks=[Counting()],
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
        ("glassloop", 0, 7, "epoch"),  # in the second set (a: 5 batches, b: 3)
        ("dataloader", 4, 7, "step"),  # the second mid-epoch validation (step 8)
        ("glassloop", 4, 27, "epoch"),  # epoch 1's end, after step 12's mid-epoch one
    ],
)
def test_a_stop_signal_inside_a_validation_abandons_it_and_the_resume_runs_it_again(
    tmp_path: Path, kind: str, every: int, at: int, due: str
) -> None:
    options = {"validate_every_n_steps": every}
    straight = make(tmp_path / "straight", **options)
    straight.fit(*loaders(kind), epochs=2)

    run = tmp_path / "stopped"
    stopped, given = make(run, at=at, **options), loaders(kind)
    with pytest.raises(Preempted) as caught:
        stopped.fit(*given, epochs=2)
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

    # glassloop's loaders: the same objects again, as a notebook's Ctrl-C and fit() again do
    resumed = make(run, **options)
    resumed.fit(*(given if kind == "glassloop" else loaders(kind)), epochs=2, resume="auto")
    assert rows(run) == rows(tmp_path / "straight")
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name
    ended = [callback.ended for trainer in (straight, resumed) for callback in trainer.callbacks]
    assert ended[0] == ended[1]  # (callback states: each validation seen once)


class SlowItem(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose item ``slow`` takes a minute (a network read, a cold cache); with
    ``slow=-1`` every item's second read does (the next epoch's first batch)."""

    def __init__(self, slow: int) -> None:
        self.data, self.slow, self.reads = data(96, 1), slow, [0] * 96

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads[i] += 1
        if i == self.slow or (self.slow == -1 and self.reads[i] == 2):
            time.sleep(60)
        return self.data[i]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kind", "workers", "stop"),
    [
        ("dataloader", 0, 12),  # a shuffling DataLoader's first batch of epoch 2: its RNG
        ("dataloader", 2, 4),  # the 2nd micro-batch of step 5, in a worker
        ("glassloop", 2, 4),  # the same, its position put back and its workers killed
    ],
)
def test_a_stop_signal_during_a_long_wait_for_data_stops_at_once(
    tmp_path: Path, kind: str, workers: int, stop: int
) -> None:
    """The one-minute read is never waited for: the run stops within seconds of the signal,
    with the last completed step's checkpoint (two micro-batches a step: the one half
    gathered is dropped, with what fetching it changed), and the resume equals the
    straight run."""

    def loader(slow: int | None = None) -> Any:
        dataset = SlowItem(-2 if slow is None else slow)
        if kind == "glassloop":  # (unshuffled: batch 9 is samples 36..39)
            return make_loader(dataset, batch_size=4, num_workers=workers)
        if workers == 0:  # shuffled from the global RNG at each epoch's start
            return DataLoader(dataset, batch_size=4, shuffle=True)
        order = [int(i) for i in torch.randperm(96, generator=torch.Generator().manual_seed(5))]
        return DataLoader(dataset, batch_size=4, sampler=order, num_workers=workers)

    slow = -1 if workers == 0 else (36 if kind == "glassloop" else 0)
    if kind == "dataloader" and workers:
        slow = [int(i) for i in torch.randperm(96, generator=torch.Generator().manual_seed(5))][36]
    options = {"grad_accum_steps": 2}
    straight = make(tmp_path / "straight", **options)
    straight.fit(loader(), epochs=2)

    run = tmp_path / "stopped"
    stopped = make(run, **options)
    sent: list[float] = []

    def signal_it() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(3.0 + workers, signal_it)
    timer.start()
    with pytest.raises(Preempted) as caught:
        stopped.fit(loader(slow), epochs=2)
    timer.cancel()
    assert sent and time.perf_counter() - sent[0] < 4  # not the minute
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert caught.value.step == stop
    resumed = make(run, **options)
    resumed.fit(loader(), epochs=2, resume="auto")
    assert rows(run) == rows(tmp_path / "straight")
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name
