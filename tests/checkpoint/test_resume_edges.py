"""Resume never dead-ends and never silently differs: the edges found by random kill trials.

A kill is emulated in-process by a model that raises ``Kill`` (a ``BaseException``, like the
``SystemExit`` of a dying process) at a chosen training forward call; a fresh ``Trainer`` then
resumes from what is on disk, as a new process would.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Callback, CheckpointError, ConfigError, Trainer
from glassloop.checkpoint.resume import config_differences
from glassloop.data import make_loader
from glassloop.errors import NonFiniteError
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.run_dir.local_store import LocalStore
from glassloop.step.throughput import TIMING


class Kill(BaseException):
    """Stands in for kill -9: raised from inside a training step."""


class Net(nn.Module):
    """An MLP with dropout that dies at training forward number ``kill_at``."""

    def __init__(self, kill_at: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.calls, self.kill_at = 0, kill_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.kill_at:
                raise Kill
        out: torch.Tensor = self.net(x)
        return out


def dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def make(run_dir: Path | None, kill_at: int = 0, **options: Any) -> Trainer:
    torch.manual_seed(0)
    model = Net(kill_at)
    checkpoint = CheckpointConfig(**options.pop("checkpoint", {}))
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        options.pop("loss_fn", nn.CrossEntropyLoss()),
        device="cpu",
        progress="none",
        run_dir=run_dir,
        checkpoint=checkpoint,
        **options,
    )


def user_loader() -> DataLoader[Any]:
    """What the README's Python example uses: a DataLoader that shuffles from the global RNG."""
    return DataLoader(dataset(), batch_size=16, shuffle=True)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def killed_then_resumed(
    tmp_path: Path, kill_at: int, loader: Any, epochs: int = 3, **options: Any
) -> Trainer:
    with pytest.raises(Kill):
        make(tmp_path / "run", kill_at, **options).fit(loader(), epochs=epochs)
    resumed = make(tmp_path / "run", **options)
    resumed.fit(loader(), epochs=epochs, resume="auto")
    return resumed


def seeded_loader() -> DataLoader[Any]:
    """The README's other pattern: a DataLoader with its own generator, built afresh (as a
    new process builds it) each time."""
    return DataLoader(
        dataset(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )


# 96 samples / batch 16 = 6 steps per epoch.
@pytest.mark.parametrize("loader", [user_loader, seeded_loader], ids=["global-rng", "generator"])
@pytest.mark.parametrize(
    ("every_n_steps", "every_n_epochs", "kill_at"),
    [(4, 1, 6), (6, 0, 8), (6, 1, 8), (6, 1, 14)],
    ids=["mid-epoch", "at-an-epochs-last-step", "at-an-epoch-boundary", "two-epochs-in"],
)
def test_a_users_shuffling_dataloader_resumes_bitwise(
    tmp_path: Path, every_n_steps: int, every_n_epochs: int, kill_at: int, loader: Any
) -> None:
    """The loader and its generator are built afresh for the resume: the generator's state
    at the checkpoint is restored into the new one (it used to start over, so the resumed
    epochs repeated the first epochs' orders: max weight diff 0.06-0.84)."""
    options = {"checkpoint": {"every_n_steps": every_n_steps, "every_n_epochs": every_n_epochs}}
    straight = make(tmp_path / "straight", **options)
    straight.fit(loader(), epochs=3)
    resumed = killed_then_resumed(tmp_path, kill_at, loader, **options)
    assert_same(weights(resumed), weights(straight))
    assert [{k: v for k, v in row.items() if k not in TIMING}
            for row in resumed.history] == [
        {k: v for k, v in row.items() if k not in TIMING}
        for row in straight.history
    ]  # fmt: skip


def test_a_checkpoint_on_an_epochs_last_batch_resumes(tmp_path: Path) -> None:
    """The fast loader used to yield one empty batch there: NaN loss, exit 4 on every retry."""

    def fast() -> Any:
        data = dataset()
        return make_loader(data.tensors, batch_size=16, shuffle=True, seed=3)

    options = {"checkpoint": {"every_n_steps": 6, "every_n_epochs": 0}}
    straight = make(tmp_path / "straight", **options)
    straight.fit(fast(), epochs=3)
    resumed = killed_then_resumed(tmp_path, 8, fast, **options)
    assert_same(weights(resumed), weights(straight))


def test_best_and_the_recorded_best_never_disagree_after_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    writes = {"n": 0}

    def counted(real: Any) -> Any:
        def write(*args: Any, **kwargs: Any) -> Any:
            writes["n"] += 1
            if writes["n"] == 4:  # the second of the two writes at the end of epoch 2
                raise Kill
            return real(*args, **kwargs)

        return write

    monkeypatch.setattr(LocalStore, "commit", counted(LocalStore.commit))
    val = DataLoader(dataset(48), batch_size=16)
    options = {"checkpoint": {"monitor": "train_loss"}}
    with pytest.raises(Kill):
        make(tmp_path / "run", **options).fit(user_loader(), val, epochs=2)
    monkeypatch.undo()
    resumed = make(tmp_path / "run", **options)
    resumed.fit(user_loader(), val, epochs=2, resume="auto")
    best = read_checkpoint(tmp_path / "run" / "best")
    assert best.meta["metrics"]["train_loss"] == resumed.state.best_metric
    assert resumed.state.best_metric == min(row["train_loss"] for row in resumed.history)


def test_resuming_a_finished_run_writes_what_its_end_left_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = make(run, ema_decay=0.9)
    first.fit(user_loader(), epochs=2)
    expected = weights_of_file(run / "model.safetensors")
    # A kill after the final checkpoint, before the final files:
    (run / "model.safetensors").unlink()
    (run / "run.json").write_text(json.dumps({"status": "running"}))
    again = make(run, ema_decay=0.9)
    again.fit(user_loader(), epochs=2, resume="auto")
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert_same(weights_of_file(run / "model.safetensors"), expected)  # the EMA weights
    assert again.state.step == first.state.step


def weights_of_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class StopAfterFirstEpoch(Callback):
    def on_epoch_end(self, trainer: Trainer, row: dict[str, Any]) -> None:
        trainer.should_stop = True


def test_an_early_stopped_run_stays_finished(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make(run, callbacks=[StopAfterFirstEpoch()]).fit(user_loader(), epochs=3)
    before = (run / "model.safetensors").read_bytes()
    again = make(run)
    again.fit(user_loader(), epochs=3, resume="auto")
    assert again.state.step == 6 and again.state.epoch == 1
    assert (run / "model.safetensors").read_bytes() == before


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_resume_with_every_checkpoint_corrupt_stops_and_touches_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make(run, checkpoint={"keep_last": 2}).fit(user_loader(), epochs=2)
    steps = sorted((run / "checkpoints").glob("step-*"))
    assert len(steps) == 2
    (steps[0] / "manifest.json").unlink()  # one without its manifest
    state = steps[1] / "state.json"
    state.write_text(state.read_text().replace("1", "2", 1))  # one failing its hash
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="no valid checkpoint to resume") as err:
        make(run).fit(user_loader(), epochs=3, resume="auto")
    assert "manifest.json is missing" in str(err.value) and "SHA-256" in str(err.value)
    assert snapshot(run) == before


class NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward (a finite loss with a poisoned gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


class PoisonAt(nn.Module):
    """A linear model whose training forward number ``at`` is poisoned: a NaN gradient with a
    finite loss (``"gradient"``) or a NaN loss (``"loss"``)."""

    def __init__(self, at: int, what: str = "gradient") -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.calls, self.at, self.what = 0, at, what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        out: torch.Tensor = self.linear(x)
        if self.calls != self.at:
            return out
        return NaNGradient.apply(out) if self.what == "gradient" else out * math.nan  # type: ignore[no-any-return]


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_nan_gradient_with_a_finite_loss_is_never_applied(clip: float) -> None:
    """With nonfinite="strict" (and "skip"): the default notices it later, see
    test_the_default_check_names_the_first_bad_step_and_saves_nothing_after_it."""
    torch.manual_seed(0)
    model = PoisonAt(3)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        device="cpu", progress="none", clip_grad_norm=clip or None, nonfinite="strict",
    )  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"step 3 \(epoch 1, batch 3\).*'linear.weight'"):
        trainer.fit(user_loader(), epochs=1)
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert trainer.state.step == 2

    torch.manual_seed(0)
    model = PoisonAt(3)
    skipping = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        device="cpu", progress="none", nonfinite="skip", clip_grad_norm=clip or None,
    )  # fmt: skip
    skipping.fit(user_loader(), epochs=1)
    assert skipping.state.skipped_steps == 1 and skipping.state.step == 5
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    for state in skipping.optimizer.state.values():
        assert all(bool(t.isfinite().all()) for t in state.values() if torch.is_tensor(t))


def test_fp16_with_nonfinite_skip_skips_and_goes_on() -> None:
    torch.manual_seed(0)
    model = PoisonAt(2, "loss")
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        device="cpu", progress="none", precision="fp16", nonfinite="skip",
    )  # fmt: skip
    trainer.fit(user_loader(), epochs=1)
    assert trainer.state.skipped_steps >= 1 and trainer.state.step >= 4


def test_clipping_covers_parameters_unfrozen_after_the_trainer_was_built() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0), nn.CrossEntropyLoss(),
        device="cpu", progress="none", clip_grad_norm=0.1,
    )  # fmt: skip
    model[0].requires_grad_(True)  # unfrozen after the Trainer was built
    before = [p.detach().clone() for p in model.parameters()]
    x, y = dataset(16).tensors
    trainer.fit([(x * 100, y)], epochs=1)  # large inputs: a gradient far above 0.1
    update = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]
    )
    assert float(update.norm()) <= 0.1 * (1 + 1e-4)  # lr 1: the update is the clipped gradient
    assert float(trainer.last_grad_norm) > 1.0  # type: ignore[arg-type]


def test_a_function_loss_resumes_in_a_new_process(tmp_path: Path) -> None:
    """repr() of a function holds its address; a fresh process has another one."""

    def fresh_loss() -> Any:
        return lambda output, target: F.cross_entropy(output, target)  # a new object each call

    run = tmp_path / "run"
    first = make(run, loss_fn=fresh_loss())  # kept alive: the next lambda gets another address
    first.fit(user_loader(), epochs=1)
    again = make(run, loss_fn=fresh_loss())
    again.fit(user_loader(), epochs=2, resume="auto")
    assert again.state.epoch == 2


def test_device_and_extended_epochs_in_the_config_check() -> None:
    assert config_differences({"device": "cpu"}, {"device": "cuda:0"}) == []
    saved = {"train": {"epochs": 3}, "scheduler": {"T_max": 3}}
    current = {"train": {"epochs": 5}, "scheduler": {"T_max": 5}}
    (change,) = config_differences(saved, current)
    assert change.startswith("train.epochs: 3 -> 5 (the learning-rate schedule spans the run")


class KillingLoss:
    """Cross-entropy that dies at call ``at`` (the model stays free of Python state, which
    torch.compile would guard on)."""

    def __init__(self, at: int = 0) -> None:
        self.calls, self.at = 0, at

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise Kill
        return F.cross_entropy(output, target)


def test_a_compiled_run_resumes_bitwise_in_a_fresh_process(tmp_path: Path) -> None:
    """80 samples in batches of 32: shapes 32, 32, 16 per epoch. Killed before the short
    batch, the fresh process meets 16 first: dynamo's automatic dynamic shapes used to compile
    other kernels for it (max diff 0.018); static shapes compile the same ones."""

    def compiled(run: Path, kill_at: int = 0) -> Trainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
        return Trainer(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), KillingLoss(kill_at),
            device="cpu", progress="none", run_dir=run, compile=True,
            checkpoint=CheckpointConfig(every_n_steps=2),
        )  # fmt: skip

    def loader() -> Any:
        return make_loader(dataset(80).tensors, batch_size=32, shuffle=True, seed=0)

    torch._dynamo.reset()
    straight = compiled(tmp_path / "straight")
    straight.fit(loader(), epochs=2)
    torch._dynamo.reset()
    with pytest.raises(Kill):
        compiled(tmp_path / "run", kill_at=3).fit(loader(), epochs=2)
    torch._dynamo.reset()  # what a new process starts with
    resumed = compiled(tmp_path / "run")
    resumed.fit(loader(), epochs=2, resume="auto")
    assert_same(weights(resumed), weights(straight))


def test_settings_added_by_a_newer_version_warn_instead_of_blocking_a_resume() -> None:
    from types import SimpleNamespace

    from glassloop.checkpoint.resume import check_compatible

    old = SimpleNamespace(
        path=Path("ck"), sharded=False, meta={"world_size": 1, "config": {"optim": {"lr": 0.1}}}
    )
    current = {"optim": {"lr": 0.1}, "loss": {"name": "cross_entropy"}, "task": "auto"}
    said: list[str] = []
    check_compatible(old, current, False, said.append)  # type: ignore[arg-type]
    assert said == [
        "warning: 'ck' was written before these settings existed, so they are not compared: "
        "loss.name: <unset> -> cross_entropy; task: <unset> -> auto"
    ]
    changed = {**current, "optim": {"lr": 0.2}}
    with pytest.raises(ConfigError, match=r"optim.lr: 0.1 -> 0.2"):
        check_compatible(old, changed, False, said.append)  # type: ignore[arg-type]


def test_a_resumed_epochs_progress_starts_where_it_stopped(tmp_path: Path) -> None:
    """Killed 4 batches (of 16) into epoch 2: the resumed epoch's bar starts at 64 samples,
    not at 0 (a wrong percentage and ETA)."""
    with pytest.raises(Kill):
        make(tmp_path / "run", kill_at=11, checkpoint={"every_n_steps": 1}).fit(
            make_loader(dataset(), batch_size=16, shuffle=True), epochs=2
        )
    resumed = make(tmp_path / "run")
    starts: list[tuple[int, int]] = []
    original = resumed.console.epoch_start

    def spy(epoch: int, num_epochs: int, total: int | None, done: int = 0) -> None:
        starts.append((epoch, done))
        original(epoch, num_epochs, total, done)

    resumed.console.epoch_start = spy  # type: ignore[method-assign]
    resumed.fit(make_loader(dataset(), batch_size=16, shuffle=True), epochs=2, resume="auto")
    assert starts == [(2, 64)]


def metric_rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_a_kill_between_an_epochs_row_and_its_checkpoint_leaves_one_row_per_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint at an epoch's last step comes before its epoch row; a kill after the
    row but before the epoch's own checkpoint resumed from the first and wrote the epoch's
    row again (weights bitwise, two rows for epoch 1)."""
    from glassloop.checkpoint.checkpointer import Checkpointer

    options = {"checkpoint": {"every_n_steps": 3}, "log_every": 1}
    straight = make(tmp_path / "straight", **options)
    straight.fit(user_loader(), epochs=2)
    save = Checkpointer.save

    def dies_at_epoch_1s_end(self: Checkpointer, **kwargs: Any) -> Any:
        if self.state.epoch == 1 and self.state.batch_in_epoch == 0:  # the epoch's own
            raise Kill
        return save(self, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", dies_at_epoch_1s_end)
    with pytest.raises(Kill):
        make(tmp_path / "run", **options).fit(user_loader(), epochs=2)
    monkeypatch.setattr(Checkpointer, "save", save)
    assert [r["epoch"] for r in metric_rows(tmp_path / "run") if r["kind"] == "epoch"] == [1]
    resumed = make(tmp_path / "run", **options)
    resumed.fit(user_loader(), epochs=2, resume="auto")
    assert_same(weights(resumed), weights(straight))
    assert metric_rows(tmp_path / "run") == metric_rows(tmp_path / "straight")


@pytest.mark.parametrize(("what", "clip", "named"), [("loss", 0.0, 3), ("gradient", 1.0, 3),
                                                      ("gradient", 0.0, 4)])  # fmt: skip
def test_the_default_check_names_the_first_bad_step_and_saves_nothing_after_it(
    tmp_path: Path, what: str, clip: float, named: int
) -> None:
    """nonfinite="raise" (the default) reads no value per step: a NaN loss (or clipped norm)
    is noticed at the next point the loop reads anyway (here the step-5 checkpoint), named
    by its step; the checkpoint is refused and the last good one (step 2) stays. A NaN
    gradient with a finite loss and no clipping shows in the next step's loss (step 4)."""
    torch.manual_seed(0)
    model = PoisonAt(3, what)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        device="cpu", progress="none", clip_grad_norm=clip or None, run_dir=tmp_path / "run",
        log_every=1000, checkpoint=CheckpointConfig(every_n_steps=5, every_n_epochs=0),
    )  # fmt: skip
    with pytest.raises(NonFiniteError, match=rf"NaN/inf at step {named}, seen at step 5"):
        trainer.fit(user_loader(), epochs=1)
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert steps == [] and not (tmp_path / "run" / "model.safetensors").exists()
    # With a checkpoint before the bad step, that one stays the newest, intact.
    torch.manual_seed(0)
    poisoned = PoisonAt(3, what)
    again = Trainer(
        poisoned, torch.optim.SGD(poisoned.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
        device="cpu", progress="none", clip_grad_norm=clip or None, run_dir=tmp_path / "again",
        checkpoint=CheckpointConfig(every_n_steps=2, every_n_epochs=0),
    )  # fmt: skip
    with pytest.raises(NonFiniteError):
        again.fit(user_loader(), epochs=1)
    latest = (tmp_path / "again" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-00000002"
    assert read_checkpoint(tmp_path / "again" / "checkpoints" / latest).step == 2


def test_the_default_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a tensor's value reaches Python from glassloop's code, counted over 300
    steps of one epoch with step rows off: a few at the epoch's ends, none per step (the
    per-step check read 306). (torch.optim's own reads of its CPU step counters are not
    device syncs and not glassloop's.)"""
    import sys

    import glassloop

    package = str(Path(glassloop.__file__).parent)
    reads = {"count": 0}
    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "numpy", "cpu"):
        real = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.startswith(package):
                reads["count"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    torch.manual_seed(0)
    x, y = torch.randn(300 * 8, 6), torch.randint(0, 3, (300 * 8,))
    loader = make_loader((x, y), batch_size=8, shuffle=True, seed=0)
    trainer = make(None, log_every=10**6)
    before = reads["count"]
    trainer.fit(loader, epochs=1)
    assert trainer.state.step == 300
    assert reads["count"] - before <= 30, reads["count"] - before


def test_a_run_has_one_training_time_and_a_resume_does_not_count_its_pause(
    tmp_path: Path,
) -> None:
    """Issue 37: the console said "done in 30.0 s", `glassloop runs` and the report "24s",
    and a resumed run's report counted the pause between the kill and the resume. Now one
    number, the seconds of training the weights hold, everywhere; the command's own seconds
    since its launch named as such."""
    import time

    from glassloop.tracking.console import format_duration
    from glassloop.tracking.runs import summarise
    from glassloop.tracking.summary import end_summary

    started = time.perf_counter()
    with pytest.raises(Kill):
        make(tmp_path / "run", 10, checkpoint={"every_n_steps": 4}).fit(user_loader(), epochs=3)
    first = json.loads((tmp_path / "run" / "checkpoints" / "step-00000008" / "meta.json")
                       .read_text())["train_s"]  # fmt: skip
    time.sleep(1.0)  # the pause a resume must not count
    resumed = make(tmp_path / "run", checkpoint={"every_n_steps": 4})
    resumed.fit(user_loader(), epochs=3, resume="auto")
    elapsed = time.perf_counter() - started
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert first < info["train_s"] < elapsed - 1.0
    said = end_summary(resumed, None)  # (the console's last lines; progress="none" here)
    assert said.startswith(f"done in {info['train_s']:.1f} s of training ({info['wall_s']:.1f} s")
    # A resume launched after more training than it did itself: its time is said as a part
    # (it read "145.7 s of training (125.8 s since launch)").
    resumed.state.wall_s = 0.01
    assert "s of training in all (0.0 s since this launch)" in end_summary(resumed, None)
    summary = summarise(tmp_path / "run")
    assert summary is not None and summary.duration == format_duration(info["train_s"])
    page = (tmp_path / "run" / "report" / "index.html").read_text()
    assert f"<td>training time</td><td>{summary.duration}</td>" in page
    launch = format_duration(info["wall_s"])
    assert f"<td>this command</td><td>{launch} since its launch</td>" in page
