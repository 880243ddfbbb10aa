"""The Trainer's contract: history, output lines, callbacks, batch forms, clear errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Callback, DataError, GlassloopError, ModelError, Trainer


def make_trainer(**kwargs: Any) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, Any] = {"device": "cpu", "progress": "none", **kwargs}
    return Trainer(model, optimizer, nn.CrossEntropyLoss(), **options)


def data(n: int = 100, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, 8, generator=g), torch.randint(0, classes, (n,), generator=g)
    )


def test_history_has_one_row_per_epoch() -> None:
    trainer = make_trainer()
    history = trainer.fit(
        DataLoader(data(), batch_size=16), DataLoader(data(40), batch_size=16), epochs=3
    )
    assert [row["epoch"] for row in history] == [1, 2, 3]
    assert history[-1]["step"] == 3 * 7  # ceil(100 / 16) optimizer steps per epoch
    assert history[-1]["samples"] == 300
    for key in ("train_loss", "val_loss", "val_accuracy", "lr", "seconds"):
        assert key in history[0]
    assert trainer.state.epoch == 3 and trainer.state.step == 21


def test_train_loss_is_the_sample_weighted_mean() -> None:
    class Recorder(Trainer):
        losses: ClassVar[list[tuple[float, int]]] = []

        def train_step(self, window: Any) -> torch.Tensor | None:
            loss = super().train_step(window)
            assert loss is not None
            self.losses.append((loss.item(), int(window[0][1].shape[0])))
            return loss

    trainer = make_trainer()
    trainer.__class__ = Recorder
    history = trainer.fit(DataLoader(data(), batch_size=16), epochs=1)
    total = sum(loss * n for loss, n in Recorder.losses) / sum(n for _, n in Recorder.losses)
    assert history[0]["train_loss"] == pytest.approx(total, rel=1e-6)


def test_plain_lines_follow_the_tutorial_format(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(progress="lines", log_every=3)
    trainer.fit(DataLoader(data(), batch_size=16), DataLoader(data(40), batch_size=16), epochs=2)
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("loss:")]
    assert re.fullmatch(r"loss: \d\.\d{6}  \[   16/  100\]", lines[0])
    assert re.fullmatch(r"loss: \d\.\d{6}  \[   64/  100\]", lines[1])  # batch 4 (every 3)
    summary = [line for line in out if line.startswith("epoch")]
    assert re.fullmatch(
        r"epoch 1/2  train_loss \d\.\d{4}  val_loss \d\.\d{4}  val_accuracy \d+\.\d\d%  "
        r"lr 1\.00e-01  \d+\.\ds",
        summary[0],
    )


def test_callback_can_stop_training() -> None:
    class StopAfterTwo(Callback):
        calls: ClassVar[list[str]] = []

        def on_fit_start(self, trainer: Trainer) -> None:
            self.calls.append("start")

        def on_epoch_end(self, trainer: Trainer, row: dict[str, Any]) -> None:
            self.calls.append(f"epoch{row['epoch']}")
            trainer.should_stop = row["epoch"] >= 2

        def on_fit_end(self, trainer: Trainer) -> None:
            self.calls.append("end")

    trainer = make_trainer(callbacks=[StopAfterTwo()])
    history = trainer.fit(DataLoader(data(), batch_size=50), epochs=10)
    assert len(history) == 2
    assert StopAfterTwo.calls == ["start", "epoch1", "epoch2", "end"]


def test_any_iterable_and_dict_batches() -> None:
    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.lin(features)

    model = DictModel()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
    )
    x, y = data().tensors
    batches = [{"features": x[i : i + 25], "labels": y[i : i + 25]} for i in range(0, 100, 25)]
    history = trainer.fit(batches, batches, epochs=2)
    assert history[-1]["step"] == 8
    assert 0.0 <= history[-1]["val_accuracy"] <= 1.0


def test_per_step_scheduler_steps_once_per_optimizer_step() -> None:
    trainer = make_trainer()
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(
        trainer.optimizer, lambda s: 1.0 / (1 + s)
    )
    trainer.scheduler_interval = "step"
    trainer.fit(DataLoader(data(), batch_size=25), epochs=2)
    assert trainer.scheduler.last_epoch == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 9)


def test_labels_out_of_range_are_a_clear_error() -> None:
    with pytest.raises(DataError) as info:
        make_trainer().fit(DataLoader(data(classes=5), batch_size=16), epochs=1)
    assert (
        "labels in the first training batch range over [0, 4] but the model has 3 outputs"
        in str(info.value)
    )
    # Out of range only in a later batch: the loss's own error, explained.
    x, y = data().tensors
    y = y.clone()
    y[90] = 7
    with pytest.raises(DataError, match=r"label is outside .*labels must be in \[0, num_outputs\)"):
        make_trainer().fit(DataLoader(TensorDataset(x, y), batch_size=16), epochs=1)


def test_nan_inputs_in_the_first_batch_are_a_clear_error() -> None:
    x, y = data().tensors
    x = x.clone()
    x[3, 2] = float("inf")
    with pytest.raises(DataError, match="first training batch has NaN or inf in input 0"):
        make_trainer().fit(DataLoader(TensorDataset(x, y), batch_size=16), epochs=1)


def test_rejected_first_batch_names_the_shape() -> None:
    trainer = make_trainer()
    bad = TensorDataset(torch.randn(10, 5), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ModelError, match=r"first batch \(\(10, 5\) float32, \(10,\) int64\)"):
        trainer.fit(DataLoader(bad, batch_size=10), epochs=1)


def test_empty_training_data_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="no batches"):
        make_trainer().fit([], epochs=1)


def test_run_dir_files(tmp_path: Path) -> None:
    trainer = make_trainer(run_dir=tmp_path / "run")
    trainer.fit(DataLoader(data(), batch_size=16), DataLoader(data(40), batch_size=16), epochs=2)
    run = tmp_path / "run"
    for name in ("config.json", "run.json", "metrics.csv", "metrics.jsonl", "model.safetensors"):
        assert (run / name).is_file(), name
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "epoch"' in line for line in lines) == 2
    assert sum('"kind": "step"' in line for line in lines) == 2  # log_every=100: batch 1 only
    from safetensors.torch import load_file

    weights = load_file(run / "model.safetensors")
    assert torch.equal(weights["1.weight"], trainer.model.state_dict()["1.weight"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"log_every": 0}, "Trainer: log_every must be >= 1, got 0"),
        ({"grad_accum_steps": 0}, "Trainer: grad_accum_steps must be >= 1, got 0"),
        (
            {"scheduler_interval": "batch"},
            "Trainer: scheduler_interval must be one of epoch, step; got 'batch'",
        ),
        ({"ema_decay": 1.0}, "Trainer: ema_decay must be in [0, 1), got 1.0"),
        (
            {"loss_reduction": "avg"},
            "Trainer: loss_reduction must be one of auto, mean, sum; got 'avg'",
        ),
        ({"profile": -1}, "Trainer: profile must be >= 0, got -1"),
        (
            {"nonfinite": "ignore"},
            "Trainer: nonfinite must be one of raise, strict, skip; got 'ignore'",
        ),
    ],
)
def test_python_api_arguments_are_checked_with_one_line(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(GlassloopError) as err:
        make_trainer(**options)
    assert str(err.value) == message


def test_half_precision_gradient_norms_that_are_finite_do_not_count_as_overflow() -> None:
    # Each gradient norm (40,000) fits in float16 (max 65,504); their sum does not. The step
    # is finite and must be taken, not refused as non-finite.
    model = nn.Linear(1, 1).half()
    with torch.no_grad():
        model.weight.fill_(0.0)
        model.bias.fill_(0.0)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 10_000.0 * output.sum()  # d(loss)/d(output) = 10,000 per sample

    x = torch.ones(4, 1, dtype=torch.float16)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-9), loss_fn,
                      device="cpu", progress="none")  # fmt: skip
    trainer.check_first_batch = lambda inputs, target: None  # type: ignore[method-assign]
    trainer.fit([(x, torch.zeros(4))], epochs=1)
    assert trainer.state.step == 1
    assert trainer.state.skipped_steps == 0


def test_the_header_of_several_processes_says_whose_batch_size_it_is() -> None:
    """Under --nproc 2 the global batch doubles (a batch size is each process's): the header
    says so, how to keep one process's batch, and that step lines count this process's."""
    from glassloop.distributed.world import World
    from glassloop.tracking.summary import start_header

    trainer = make_trainer()
    trainer.world = World(rank=0, size=2)
    header = start_header(trainer, DataLoader(data(), batch_size=64), None, 1)
    assert (
        "batch: 128 = 64 per step x 1 accumulation x 2 processes; the batch size is each "
        "process's, so 2 processes take 2x one process's samples per step (batch size 32 keeps "
        "64); step lines count this process's samples"
    ) in header


def test_start_header_and_end_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trainer = make_trainer(progress="lines", run_dir=tmp_path / "run")
    trainer.fit(DataLoader(data(), batch_size=16), DataLoader(data(40), batch_size=16), epochs=2)
    out = capsys.readouterr().out
    assert "model: Sequential, 27 parameters (27 trainable)" in out
    assert "data: 100 training samples, 40 validation; 7 steps per epoch, 2 epochs" in out
    assert "batch: 16 = 16 per step x 1 accumulation x 1 process" in out
    assert "optimizer: SGD (lr 0.1" in out and "schedule: none" in out
    summary = out.splitlines()[-3:]
    assert re.fullmatch(
        r"done in \d+\.\d s of training \(\d+\.\d s since launch\): 2 epochs, 14 steps; best val_loss \d\.\d+ \(epoch \d\); "
        r"final val_accuracy \d+\.\d\d%",
        summary[0],
    )
    # Each checkpoint's times (medians; the end's and each epoch's: 3 saves)
    assert re.fullmatch(
        r"checkpoints: 3 saved, the step held \d+\.\d\d s each, written in \d+\.\d\d s "
        r"\((\d+\.\d\d GB/s|[\d.e-]+ MB/s); medians\)",
        summary[1],
    )
    report = tmp_path / "run" / "report" / "index.html"
    assert summary[2] == f"weights: {tmp_path / 'run' / 'model.safetensors'}; report: {report}"
    assert report.is_file()  # a run made in Python gets its report too
    make_trainer(progress="none").fit(DataLoader(data(), batch_size=16), epochs=1)
    assert capsys.readouterr().out == ""  # progress="none": silent


def test_progress_auto_bar_on_a_terminal_lines_into_a_redirected_stdout() -> None:
    from glassloop.tracking.console import resolve_progress

    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    assert resolve_progress("auto", Stream(True), Stream(False)) == (True, True)  # > train.log
    assert resolve_progress("auto", Stream(True), Stream(True)) == (True, False)  # a terminal
    assert resolve_progress("auto", Stream(False), Stream(False)) == (False, True)  # CI
    assert resolve_progress("lines", Stream(True), Stream(True)) == (False, True)


def test_namedtuple_and_dataclass_batches_keep_their_type_and_move_every_tensor() -> None:
    """Namedtuples came back as plain tuples and a dataclass's tensors were never moved
    (on a GPU a device-mismatch error at best). The meta device stands in for a GPU."""
    from collections import namedtuple
    from dataclasses import dataclass, field

    from glassloop.device import move_to_device

    Pair = namedtuple("Pair", "x y")

    @dataclass
    class Batch:
        x: torch.Tensor
        mask: torch.Tensor
        name: str = "b"
        extra: dict[str, Any] = field(default_factory=dict)

    meta = torch.device("meta")
    pair = move_to_device(Pair(torch.zeros(2), torch.ones(2)), meta)
    assert type(pair) is Pair and pair.x.device == meta and pair.y.device == meta
    batch = move_to_device(
        Batch(torch.zeros(2), torch.ones(2), extra={"t": [torch.zeros(1)]}), meta
    )
    assert type(batch) is Batch and batch.name == "b"
    assert (
        batch.x.device == meta and batch.mask.device == meta and batch.extra["t"][0].device == meta
    )
    # And a namedtuple batch trains like a tuple: the last field is the target.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      device="cpu", progress="none")  # fmt: skip
    history = trainer.fit([Pair(x[:4], y[:4]), Pair(x[4:], y[4:])], epochs=1)
    assert history[0]["step"] == 2


@pytest.mark.parametrize("workers", [False, True], ids=["in-memory", "resumable"])
def test_limit_batches_takes_the_first_batches_of_every_epochs_order(workers: bool) -> None:
    """glassloop's loaders counted the batches they yielded and reset only at an epoch's
    end, and the loop cut them: epoch 1 validated on batches 0-2, epoch 2 on 3-5, epoch 3
    stopped with "the evaluation set is empty"; training epoch k took batches 3k..3k+2 of
    the first epoch's order."""
    from glassloop.data import make_loader

    seen: dict[str, list[list[float]]] = {"train": [], "val": []}

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["train" if self.training else "val"].append(x[:, 0].tolist())
            out: torch.Tensor = self.linear(x)
            return out

    x = torch.arange(40, dtype=torch.float32)[:, None]
    y = torch.zeros(40, dtype=torch.long)
    options = {"num_workers": 1} if workers else {}

    def loader(shuffle: bool) -> Any:
        return make_loader((x, y), batch_size=4, shuffle=shuffle, seed=3, **options)

    class Unchecked(Trainer):
        def check_first_batch(self, inputs: Any, target: Any) -> None:
            pass  # (its eval-mode forward would be recorded as a validation batch)

    model = Recorder()
    trainer = Unchecked(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                        device="cpu", progress="none", limit_batches=3)  # fmt: skip
    trainer.fit(loader(True), loader(False), epochs=4)
    full = loader(True)
    orders = [[b[0][:, 0].tolist() for b in full] for _ in range(4)]  # epochs 1-4, whole
    assert seen["train"] == [batch for order in orders for batch in order[:3]]
    first_val = [b[0][:, 0].tolist() for b in loader(False)][:3]
    assert seen["val"] == first_val * 4


def test_counts_of_one_read_as_one(capsys: pytest.CaptureFixture[str]) -> None:
    """The header and the end summary say "1 thread", "1 epoch", "1 step" (issue 37)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        make_trainer(progress="lines").fit([(torch.randn(4, 8), torch.zeros(4).long())], epochs=1)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "cpu (1 thread)," in out and ", 1 epoch\n" in out
    assert "done in " in out and ": 1 epoch, 1 step" in out
