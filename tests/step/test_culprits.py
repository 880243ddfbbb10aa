"""One line instead of a traceback, naming the right culprit (issue 32, item 4): the optimizer
for its own errors, never the model for glassloop's own guard; refusals in the constructor
and the config; files of a run directory that are not text; read-only output folders."""

from __future__ import annotations

import functools
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runner import cli, sets
from torch import nn

from glassloop import Trainer
from glassloop.config.schema import load_config
from glassloop.errors import ConfigError, DataError, ModelError
from glassloop.state import TrainState
from glassloop.step.guards import LossSpikeError, NonFiniteWatch

X, Y = torch.randn(64, 4), torch.randint(0, 3, (64,))
BATCHES = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)]


def fit(
    optimizer: Any, model: nn.Module | None = None, batches: Any = BATCHES, **options: Any
) -> None:
    """One epoch; ``optimizer``: an optimizer, or a function of the model that makes one."""
    model = model if model is not None else nn.Linear(4, 3)
    made = optimizer(model) if callable(optimizer) else optimizer
    Trainer(model, made, nn.CrossEntropyLoss(), progress="none", **options).fit(batches, epochs=1)


def one_line(err: pytest.ExceptionInfo[Exception]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_capturable_on_a_cpu_is_refused_in_the_constructor() -> None:
    with pytest.raises(ConfigError) as err:
        fit(lambda m: torch.optim.Adam(m.parameters(), capturable=True))
    assert one_line(err).startswith("optim: capturable = true needs parameters on cuda")
    assert "they are on cpu" in str(err.value)


def test_an_optimizer_error_names_the_optimizer_and_its_option_not_the_model() -> None:
    with pytest.raises(ConfigError) as err:
        fit(lambda m: torch.optim.LBFGS(m.parameters(), history_size=0))
    text = one_line(err)
    assert text.startswith("optim: LBFGS.step() failed at epoch 1, batch 1: IndexError")
    assert text.endswith("differ from the defaults: history_size=0")
    with pytest.raises(ConfigError, match=r"optim: Adam.step\(\) .* differentiable=True$"):
        fit(lambda m: torch.optim.Adam(m.parameters(), differentiable=True))


def test_the_config_refuses_what_only_the_optimizers_step_refuses() -> None:
    with pytest.raises(ConfigError, match=r"LBFGS refuses these arguments \(history_size=0\)"):
        load_config(None, ["optim.name=LBFGS", "optim.history_size=0"])
    with pytest.raises(ConfigError, match=r"AdamW refuses these arguments \(differentiable"):
        load_config(None, ["optim.differentiable=true"])
    assert load_config(None, ["optim.capturable=true"]).optim.kwargs["capturable"]  # a GPU's


def test_a_sparse_input_passes_the_first_batch_guard_and_a_nan_in_it_does_not() -> None:
    """The pytorch/examples GCN: a sparse adjacency the model accepts (torch.isfinite has no
    sparse kernel: the guard's own limit was reported as the model's fault)."""
    n = 16
    edges = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])

    class GCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(adj, self.linear(x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's note on sparse invariant checks)
        adj = torch.sparse_coo_tensor(edges, torch.ones(n), (n, n))
        bad = torch.sparse_coo_tensor(edges, torch.full((n,), float("nan")), (n, n))
    model = GCN()
    fit(torch.optim.SGD(model.parameters(), lr=0.1), model, batches=[(X[:n], adj, Y[:n])])
    with pytest.raises(DataError, match="NaN or inf in input 1"):
        fit(torch.optim.SGD(model.parameters(), lr=0.1), model, batches=[(X[:n], bad, Y[:n])])


def test_sparse_gradients_under_strict_checks_and_clipping() -> None:
    """nn.Embedding(sparse=True): the strict check reads their values; torch's clipping
    cannot clip them, said as clipping's limit, not the model's."""
    x, y = torch.randint(0, 10, (32, 3)), torch.randint(0, 2, (32,))

    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2))

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    for policy in ("strict", "skip"):
        m = model()
        fit(sgd(m.parameters()), m, [(x, y)], nonfinite=policy)
    m = model()
    with pytest.raises(ConfigError, match=r"^train: clipping the gradients .* sparse gradients"):
        fit(sgd(m.parameters()), m, [(x, y)], clip_grad_norm=1.0)


def test_an_empty_optimizer_dict_or_a_class_is_refused_in_the_constructor() -> None:
    with pytest.raises(ConfigError, match=r"^optimizer: an empty dict of optimizers"):
        fit({})
    with pytest.raises(ConfigError, match=r"^optimizer: the class SGD is not an optimizer"):
        Trainer(nn.Linear(4, 3), torch.optim.SGD, nn.CrossEntropyLoss())  # type: ignore[arg-type]


class ForwardForward(nn.Module):
    """pytorch/examples mnist_forward_forward: its own train(x_pos, x_neg)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def train(self, x_pos: torch.Tensor, x_neg: torch.Tensor) -> None:  # type: ignore[override]
        pass


class OwnTrain(ForwardForward):
    def train(self, mode: bool = True) -> OwnTrain:  # type: ignore[override]
        return super(ForwardForward, self).train(mode)  # (an override nn.Module allows)


class NoWeights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3]


def test_a_model_the_loop_cannot_drive_is_refused_in_the_constructor() -> None:
    other = nn.Linear(2, 2)
    with pytest.raises(ModelError) as err:
        fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ForwardForward())
    assert one_line(err).startswith("model: ForwardForward defines its own train() (not")
    with pytest.raises(ModelError, match=r"^model: NoWeights registers no parameters"):
        fit(torch.optim.SGD(other.parameters(), lr=0.1), NoWeights())
    fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), OwnTrain())  # trains


class Layers(nn.Module):
    """mnist_forward_forward's Net: its Layers, each with train(x_pos, x_neg), in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([OwnTrain(), ForwardForward()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](x)


def test_a_submodule_the_loop_cannot_drive_is_named_by_its_path() -> None:
    """Accepted by the constructor, it was a raw TypeError at fit's model.train(), which
    calls each child's train(mode)."""
    with pytest.raises(ModelError) as err:
        fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), Layers())
    assert one_line(err).startswith(
        "model: ForwardForward (model.layers.1) defines its own train() (not nn.Module's "
        "train(mode=True))"
    )


def test_loss_spike_at_or_below_1_is_refused_in_the_trainer_and_the_config() -> None:
    for spike in (0.5, 1.0):
        with pytest.raises(ConfigError, match=r"^Trainer: loss_spike must be 0 \(off\) or over 1"):
            fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_spike=spike)
        with pytest.raises(ConfigError, match=r"^config: train.loss_spike must be 0 \(off\)"):
            load_config(None, [f"train.loss_spike={spike}"])
    assert load_config(None, ["train.loss_spike=1.5"]).train.loss_spike == 1.5


def spike_at(losses: list[float], spike: float = 10.0) -> str:
    watch, state = NonFiniteWatch(spike=spike), TrainState()
    try:
        for loss in losses:
            state.step += 1
            watch.observe_step(torch.tensor(loss), state, 1)
            watch.check(state)
    except LossSpikeError as err:
        return str(err)
    return ""


def test_the_spike_guard_works_for_negative_losses() -> None:
    """A median of -2 and spike 10: a loss over -2 + 9 x 2 = 16 stops (it was silently off
    below zero); a falling negative loss does not; positive losses as before."""
    steady = [-2.0 + 0.01 * (i % 3) for i in range(20)]
    found = spike_at([*steady, 17.0])
    assert found.startswith("train: a loss spike at step 21"), found
    assert "17, 9.54 times |median| above the median -1.99" in found
    assert spike_at([*steady, 15.0]) == ""
    assert spike_at([-float(i) for i in range(40)]) == ""  # falling
    assert "times the median 1" in spike_at([*[1.0] * 20, 11.5])
    assert spike_at([*[1.0] * 20, 9.5]) == ""


def test_model_kwargs_for_a_built_in_model_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.kwargs={hidden=[8]}"])
    assert one_line(err) == (
        "config: model.kwargs is for a model.target model only; the built-in 'mlp' takes "
        "model.hidden, model.dropout (set those instead), or set model.target = "
        "'package.module:Class'"
    )


DATA = ["data.name=synthetic", "data.num_samples=200", "data.num_features=8"]
SMALL = sets([*DATA, "model.hidden=[8]", "train.progress=none", "data.batch_size=32"])
ONE = ["--set", "train.epochs=1", "--set", "scheduler.name=none"]


def test_a_binary_latest_pointer_or_metrics_file_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Like a damaged pointer: the step folders are scanned; the runs table and the report
    skip an undecodable metrics line."""
    run = tmp_path / "run"
    assert cli(capsys, "train", *SMALL, *ONE, "--run-dir", str(run))[0] == 0
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00binary")
    longer = [*SMALL, "--set", "train.epochs=2", "--set", "scheduler.name=none"]
    code, out, err = cli(capsys, "train", *longer, "--run-dir", str(run), "--resume")
    assert code == 0, err
    assert "resumed from" in out + err
    with (run / "metrics.jsonl").open("ab") as handle:
        handle.write(b"\xff\xfe\x00binary\n")
    code, out, err = cli(capsys, "runs", str(run))
    assert code == 0 and "finished" in out, err
    assert cli(capsys, "report", str(run))[0] == 0


def chattr(path: Path, flag: str) -> bool:
    done = subprocess.run(["chattr", "-R", flag, str(path)], capture_output=True, check=False)
    return done.returncode == 0


def test_report_and_export_into_a_read_only_folder_are_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    assert cli(capsys, "train", *SMALL, *ONE, "--run-dir", str(run))[0] == 0
    out.mkdir()
    if not (chattr(run, "+i") and chattr(out, "+i")):  # immutable: refused even to root
        pytest.skip("chattr +i is not available here")
    try:
        code, _, err = cli(capsys, "report", str(run))
        assert code == 3, err
        assert err.strip().splitlines() == [err.strip()]
        assert err.startswith(f"glassloop: error: report: could not write '{run}/report/")
        assert "Operation not permitted (EPERM); the run's own files are unchanged" in err
        code, _, err = cli(capsys, "export", str(run), "-o", str(out / "m.safetensors"))
        assert code == 3, err
        assert err.startswith(f"glassloop: error: export: could not write '{out}/")
    finally:
        chattr(run, "-i")
        chattr(out, "-i")
    assert list(out.iterdir()) == []
