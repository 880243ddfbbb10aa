"""Training shapes beyond one model, one optimizer, one loss: each bitwise against the loop a
user would write by hand, and resumed exactly.

- An optimizer whose ``step`` takes a closure (LBFGS, as pytorch/examples'
  time-sequence prediction uses it) through the default ``train_step``.
- Several models and optimizers (pytorch/examples' DCGAN step) with the loop's own
  ``backward``/``step``, named losses reported, killed mid-epoch and resumed.
- Several validation sets by name, each equal to ``evaluate`` on it, monitorable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from regression_data import linear_batches
from torch import nn

from glassloop import Callback, ConfigError, Trainer
from glassloop.options import CheckpointConfig
from glassloop.step.throughput import TIMING


def lbfgs_model() -> tuple[nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)


def hand_lbfgs(epochs: int, accumulate: int = 1) -> tuple[nn.Module, list[float]]:
    """What the time-sequence example does: ``optimizer.step(closure)``; with
    ``accumulate`` batches, the closure's objective is their sample-weighted mean."""
    model, optimizer = lbfgs_model()
    batches, losses = linear_batches(), []
    for _ in range(epochs):
        for i in range(0, len(batches), accumulate):
            window = batches[i : i + accumulate]
            total = sum(len(y) for _, y in window)

            def closure(window: Any = window, total: int = total) -> torch.Tensor:
                optimizer.zero_grad()
                loss = torch.zeros(())
                for x, y in window:
                    part = nn.functional.mse_loss(model(x), y)
                    if accumulate > 1:
                        part = part * (len(y) / total)
                    part.backward()
                    loss = loss + part.detach()
                return loss

            losses.append(float(optimizer.step(closure)))  # type: ignore[arg-type]
    return model, losses


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_closure_optimizer_trains_as_its_hand_loop(accumulate: int) -> None:
    expected, hand_losses = hand_lbfgs(epochs=2, accumulate=accumulate)
    model, optimizer = lbfgs_model()
    trainer = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", log_every=1,
        grad_accum_steps=accumulate,
    )  # fmt: skip
    history = trainer.fit(linear_batches(), epochs=2)
    for ours, theirs in zip(
        model.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)
    # Each step's loss is the one the optimizer's first evaluation returned (as by hand).
    half = len(hand_losses) // 2
    assert history[0]["train_loss"] == pytest.approx(sum(hand_losses[:half]) / half, rel=1e-6)


def test_a_closure_optimizer_resumes_exactly(tmp_path: Path) -> None:
    expected, _ = hand_lbfgs(epochs=3)
    model, optimizer = lbfgs_model()
    first = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", run_dir=tmp_path / "run",
        checkpoint=CheckpointConfig(every_n_steps=3, every_n_epochs=0),
    )  # fmt: skip
    first.fit(linear_batches(), epochs=1)  # (the last checkpoint: the end of epoch 1, step 4)
    model, optimizer = lbfgs_model()  # a fresh model and optimizer, as a new process builds
    again = Trainer(
        model, optimizer, nn.MSELoss(), device="cpu", progress="none", run_dir=tmp_path / "run",
        checkpoint=CheckpointConfig(every_n_steps=3, every_n_epochs=0),
    )  # fmt: skip
    again.fit(linear_batches(), epochs=3, resume="auto")
    for ours, theirs in zip(
        model.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"clip_grad_norm": 1.0}, "gradient clipping"),
        ({"nonfinite": "strict"}, "train.nonfinite = 'strict'"),
        ({"precision": "fp16"}, "train.precision = 'fp16'"),
    ],
)
def test_what_a_closure_optimizer_does_not_support_is_one_line(
    options: dict[str, Any], refused: str
) -> None:
    model, optimizer = lbfgs_model()
    with pytest.raises(ConfigError, match=f"closure .LBFGS. does not support {refused}"):
        Trainer(model, optimizer, nn.MSELoss(), device="cpu", progress="none", **options)


# ------------------------------------------------------------------------ a GAN (DCGAN's loop)
def gan() -> tuple[nn.ModuleDict, dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(0)
    nets = nn.ModuleDict({
        "g": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)),
        "d": nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)),
    })  # fmt: skip
    optimizers = {
        "g": torch.optim.Adam(nets["g"].parameters(), lr=2e-3, betas=(0.5, 0.999)),
        "d": torch.optim.Adam(nets["d"].parameters(), lr=2e-3, betas=(0.5, 0.999)),
    }
    return nets, optimizers


def real_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    real = torch.randn(96, 8, generator=g) * 0.5 + 2.0
    return [(x, torch.zeros(len(x))) for x in real.split(16)]  # (the label is unused)


def gan_step(
    nets: nn.ModuleDict, real: torch.Tensor, backward: Any, step_d: Any, step_g: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """pytorch/examples' DCGAN step: D on real and fake, then G through D."""
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    nets["d"].zero_grad()  # (G's step left gradients in D, as in the example)
    fake = nets["g"](torch.randn(len(real), 4))
    d_loss = bce(nets["d"](real), ones) + bce(nets["d"](fake.detach()), zeros)
    backward(d_loss)
    step_d(d_loss)
    g_loss = bce(nets["d"](fake), ones)
    backward(g_loss)
    step_g(g_loss)
    return d_loss.detach(), g_loss.detach()


def hand_gan(epochs: int) -> tuple[nn.ModuleDict, list[tuple[float, float]]]:
    nets, optimizers = gan()
    schedulers = {k: torch.optim.lr_scheduler.StepLR(o, 4, 0.5) for k, o in optimizers.items()}
    losses = []
    for _ in range(epochs):
        for real, _ in real_batches():

            def step(name: str) -> Any:
                def take(loss: torch.Tensor) -> None:
                    optimizers[name].step()
                    optimizers[name].zero_grad()

                return take

            d, g = gan_step(nets, real, lambda loss: loss.backward(), step("d"), step("g"))
            for scheduler in schedulers.values():
                scheduler.step()
            losses.append((float(d), float(g)))
    return nets, losses


class GANTrainer(Trainer):
    """The example's step in train_step, with the loop's own backward and step."""

    def train_step(self, window: Any) -> dict[str, torch.Tensor]:
        ((((real,), _), _),) = window
        d, g = gan_step(
            self.model, real, self.backward,
            lambda loss: self.step(self.optimizer["d"], loss),
            lambda loss: self.step(self.optimizer["g"], loss),
        )  # fmt: skip
        return {"d": d, "g": g}


class StopAt(Exception):
    pass


def gan_trainer(run_dir: Path | None, stop_at: int = 0) -> tuple[GANTrainer, nn.ModuleDict]:
    nets, optimizers = gan()
    schedulers = {k: torch.optim.lr_scheduler.StepLR(o, 4, 0.5) for k, o in optimizers.items()}

    class Stop(Callback):
        def on_step_end(self, trainer: Any, step: int, loss: torch.Tensor) -> None:
            if step == stop_at:
                raise StopAt  # a crash mid-epoch, after the step-3 checkpoint

    trainer = GANTrainer(
        nets, optimizers, None, task="custom", scheduler=schedulers, scheduler_interval="step",
        device="cpu", progress="none", run_dir=run_dir, callbacks=[Stop()] if stop_at else [],
        checkpoint=CheckpointConfig(every_n_steps=3, every_n_epochs=0),
    )  # fmt: skip
    return trainer, nets


def test_a_gan_trains_as_its_hand_loop_and_reports_each_loss() -> None:
    expected, hand_losses = hand_gan(epochs=2)
    trainer, nets = gan_trainer(None)
    history = trainer.fit(real_batches(), epochs=2)
    for ours, theirs in zip(
        nets.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)
    steps = len(real_batches())
    for epoch, row in enumerate(history):
        part = hand_losses[epoch * steps : (epoch + 1) * steps]
        assert row["train_d"] == pytest.approx(sum(d for d, _ in part) / steps, rel=1e-6)
        assert row["train_g"] == pytest.approx(sum(g for _, g in part) / steps, rel=1e-6)
        assert row["train_loss"] == pytest.approx(row["train_d"] + row["train_g"], rel=1e-6)
    assert history[-1]["lr"] == pytest.approx(2e-3 * 0.5**3)  # 12 steps of StepLR(4, 0.5)


def test_a_gan_killed_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    expected, _ = hand_gan(epochs=2)
    straight, _ = gan_trainer(None)
    rows = straight.fit(real_batches(), epochs=2)
    crashed, _ = gan_trainer(tmp_path / "run", stop_at=5)
    with pytest.raises(StopAt):
        crashed.fit(real_batches(), epochs=2)
    torch.manual_seed(1234)  # a new process: its RNG is anything until the checkpoint's
    again, nets = gan_trainer(tmp_path / "run")
    resumed = again.fit(real_batches(), epochs=2, resume="auto")
    for ours, theirs in zip(
        nets.state_dict().values(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)
    assert resumed == [
        {**row, **{k: r[k] for k in TIMING if k in r}} for row, r in zip(rows, resumed, strict=True)
    ]


# ------------------------------------------------------------------- several validation sets
def test_several_validation_sets_each_equal_evaluate_and_monitorable(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(160, 6), torch.randint(0, 3, (160,))
    train = list(zip(x[:96].split(32), y[:96].split(32), strict=True))
    near = list(zip(x[96:128].split(16), y[96:128].split(16), strict=True))
    far = [(a * 4 + 3, b) for a, b in zip(x[128:].split(16), y[128:].split(16), strict=True)]
    model = nn.Linear(6, 3)

    rows: list[dict[str, Any]] = []

    class Seen(Callback):
        def on_epoch_end(self, trainer: Any, row: dict[str, Any]) -> None:
            sets = {"near": near, "far": far}
            # Each set's numbers equal evaluate() on it, at the same weights.
            for name, loader in sets.items():
                expected = trainer.evaluate(loader)
                for key in ("loss", "accuracy"):
                    assert row[f"val_{name}_{key}"] == expected[key]
            rows.append(dict(row))

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), device="cpu",
        progress="none", run_dir=tmp_path / "run", callbacks=[Seen()],
        checkpoint=CheckpointConfig(monitor="val_far_loss"),
    )  # fmt: skip
    history = trainer.fit(train, {"near": near, "far": far}, epochs=3)
    assert len(rows) == 3
    for row in history:
        # The first set's numbers are also the plain val_* (what defaults refer to).
        assert row["val_loss"] == row["val_near_loss"]
        assert row["val_accuracy"] == row["val_near_accuracy"]
    best = min(history, key=lambda row: row["val_far_loss"])
    meta = (tmp_path / "run" / "best" / "meta.json").read_text()
    assert f'"step": {best["step"]}' in meta
    metrics = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "val_far_loss" in metrics and "val_near_accuracy" in metrics


def write_npz(path: Path, rows: int, shift: float, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(rows, 6)) + shift).astype("float32")
    np.savez(path, x=x, y=(x[:, 0] > shift).astype("int64") + (x[:, 1] > shift))


def test_a_config_names_further_validation_sets_each_equal_evaluate(tmp_path: Path) -> None:
    """[data] val_sets = {ood = "ood.npz"}: the set's numbers as val_ood_*, equal to
    evaluate() on it; the configured validation split stays val_*."""
    from glassloop.config.assemble import build
    from glassloop.config.schema import load_config
    from glassloop.evaluation.evaluate import evaluate

    write_npz(tmp_path / "train.npz", 200, 0.0, 0)
    write_npz(tmp_path / "ood.npz", 60, 1.5, 1)
    cfg = load_config(None, [
        "data.name=npz", f"data.path={tmp_path / 'train.npz'}", "data.batch_size=32",
        "model.name=mlp", "model.hidden=[8]", "train.epochs=2", "train.device=cpu",
        "train.progress=none", f'data.val_sets={{ood = "{tmp_path / "ood.npz"}"}}',
        "checkpoint.monitor=val_ood_loss",
    ])  # fmt: skip
    run = build(cfg, run_dir=tmp_path / "run")
    history = run.trainer.fit(run.train_loader, run.validation, epochs=2)
    ood = run.val_sets["ood"]
    assert len(ood.dataset) == 60  # type: ignore[attr-defined]
    final = evaluate(run.trainer.eval_model, ood, run.trainer.loss_fn, device=torch.device("cpu"))
    assert history[-1]["val_ood_loss"] == final["loss"]
    assert history[-1]["val_ood_accuracy"] == final["accuracy"]
    own = evaluate(run.trainer.eval_model, run.val_loader, run.trainer.loss_fn)
    assert history[-1]["val_loss"] == own["loss"]  # the configured split: still val_*


def test_a_further_validation_set_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    from glassloop.config.assemble import build_parts
    from glassloop.config.schema import load_config
    from glassloop.errors import DataError

    write_npz(tmp_path / "train.npz", 100, 0.0, 0)
    base = ["data.name=npz", f"data.path={tmp_path / 'train.npz'}", "model.name=mlp",
            "train.device=cpu"]  # fmt: skip
    missing = load_config(None, [*base, 'data.val_sets={ood = "nowhere.npz"}'])
    with pytest.raises(DataError, match=r"data\.val_sets\.ood must .* existing \.npz file"):
        build_parts(missing)
    import numpy as np

    np.savez(tmp_path / "wide.npz", x=np.zeros((5, 7), "float32"), y=np.zeros(5, "int64"))
    wide = load_config(None, [*base, f'data.val_sets={{w = "{tmp_path / "wide.npz"}"}}'])
    with pytest.raises(DataError, match=r"inputs shaped \(7,\); the training inputs are \(6,\)"):
        build_parts(wide)
    digits = load_config(None, ["data.name=digits", 'data.val_sets={ood = "x.npz"}'])
    with pytest.raises(ConfigError, match=r"data\.val_sets reads \.npz files"):
        build_parts(digits)
