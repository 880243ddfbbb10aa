"""glassloop doctor: each classic mistake gives its FAIL; a healthy setup passes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runner import run_glassloop
from torch import nn

from glassloop import load_config
from glassloop.tools.checklist import run_doctor

MODELS = '''
import torch
from torch import nn

def DoubleSoftmax():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmax(dim=1))

def FiveOutputs():
    return nn.Sequential(nn.Linear(32, 5))

def Frozen():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    model[0].weight.requires_grad_(False)
    return model

class CannotLearn(nn.Module):
    """Its output ignores its weights: nothing it does can fit the labels."""
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 10)
    def forward(self, x):
        return self.linear(x) * 0.0
'''


def status(tmp_path: Path, target: str | None) -> dict[str, str]:
    (tmp_path / "models.py").write_text(MODELS)
    overrides = ["data.name=synthetic", "train.progress=none", "model.hidden=[64]"]
    if target:
        overrides.append(f"model.target={tmp_path / 'models.py'}:{target}")
    checks = run_doctor(load_config(None, overrides), output=tmp_path / "doctor", overfit_steps=200)
    return {c.name: c.status for c in checks}


@pytest.mark.parametrize(
    ("target", "failing"),
    [
        ("DoubleSoftmax", "softmax + CE"),
        ("FiveOutputs", "labels"),
        ("Frozen", "gradient flow"),
        ("CannotLearn", "overfit one batch"),
    ],
)
def test_each_mistake_fails_its_check(tmp_path: Path, target: str, failing: str) -> None:
    result = status(tmp_path, target)
    assert result[failing] == "FAIL", result


def test_labels_counted_from_one_are_not_passed() -> None:
    """Labels 1..10 for 10 classes (a data set counted from 1) make 11 outputs, one never
    trained: the labels check says so (it passed: every label was below 11)."""
    from glassloop.tools.checklist import check_labels

    check = check_labels(torch.arange(1, 11).repeat(5), 11)
    assert check.status == "WARN" and "subtract 1" in check.line(), check.line()
    assert check_labels(torch.arange(0, 10).repeat(5), 10).status == "PASS"


def test_a_healthy_setup_passes_and_draws_the_lr_curve(tmp_path: Path) -> None:
    result = status(tmp_path, None)
    assert "FAIL" not in result.values(), result
    png = (tmp_path / "doctor" / "lr_range.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(tmp_path / "doctor" / "lr_range.png") as image:
        assert image.size[0] > 100


def test_doctor_cli_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text(MODELS)
    base = ["doctor", "--set", "data.name=synthetic", "--output", str(tmp_path / "d")]
    bad = run_glassloop(*base, "--set", f"model.target={tmp_path / 'models.py'}:DoubleSoftmax")
    assert bad.returncode == 1
    assert "FAIL  softmax + CE" in bad.stdout and " 0 failed" not in bad.stdout
    good = run_glassloop(*base)
    assert good.returncode == 0, good.stdout
    assert "PASS  initial loss" in good.stdout
    # Without --output nothing is written (it left runs/doctor-<time>/ behind, issue 37)
    (tmp_path / "here").mkdir()
    plain = run_glassloop("doctor", "--set", "data.name=synthetic", cwd=tmp_path / "here")
    assert plain.returncode == 0, plain.stdout
    assert "--output DIR draws the curve" in plain.stdout
    assert list((tmp_path / "here").iterdir()) == []


def test_a_softmax_before_cross_entropy_stops_fit_at_the_first_batch() -> None:
    """It trained silently before (81.5% instead of ~97% in two epochs, issue 37): now the
    first-batch guard says so in one line, before any step."""
    import pytest
    import torch
    from torch import nn

    import glassloop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    before = [p.clone() for p in model.parameters()]
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none")  # fmt: skip
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    with pytest.raises(glassloop.ModelError) as caught:
        trainer.fit(data, epochs=1)
    assert str(caught.value).startswith(
        "model: its outputs on the first training batch are probabilities (each row in [0, 1], "
        "summing to 1): a softmax before nn.CrossEntropyLoss"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # log-softmax before it changes nothing (log-softmax of log-probabilities: themselves),
    # and NLLLoss takes them as they are: both train.
    for last, loss in ((nn.LogSoftmax(dim=1), nn.CrossEntropyLoss()),
                       (nn.LogSoftmax(dim=1), nn.NLLLoss())):  # fmt: skip
        fine = nn.Sequential(nn.Linear(4, 3), last)
        glassloop.Trainer(fine, torch.optim.SGD(fine.parameters(), lr=0.1), loss,
                          progress="none").fit(data, epochs=1)  # fmt: skip


def test_the_python_doctor_runs_the_checks_on_a_trainer_and_leaves_it_as_it_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch
    from torch import nn

    import glassloop

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g)
    data = [(x, x[:, :3].argmax(1))]
    healthy = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3))
    before = {k: v.clone() for k, v in healthy.state_dict().items()}
    trainer = glassloop.Trainer(healthy, torch.optim.SGD(healthy.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none")  # fmt: skip
    checks = glassloop.doctor(trainer, data)
    assert [(c.name, c.status) for c in checks] == [
        ("labels", "PASS"), ("softmax + CE", "PASS"), ("initial loss", "PASS"),
        ("gradient flow", "PASS"), ("overfit one batch", "PASS"), ("train vs eval mode", "PASS"),
    ]  # fmt: skip
    assert capsys.readouterr().out.count("PASS") == 6
    assert all(torch.equal(before[k], v) for k, v in healthy.state_dict().items())
    # The classic mistakes, each its FAIL: a dead branch, labels beyond the outputs.
    dead = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    dead[0].bias.data.fill_(-100.0)  # every ReLU off: no gradient reaches the first layer
    found = glassloop.doctor(glassloop.Trainer(dead, torch.optim.SGD(dead.parameters(), lr=0.1),
                             nn.CrossEntropyLoss(), progress="none"), data, echo=False)  # fmt: skip
    assert ("gradient flow", "FAIL") in [(c.name, c.status) for c in found]
    wrong = [(x, x[:, :3].argmax(1) + 1)]  # labels 1..3 for 3 outputs
    found = glassloop.doctor(trainer, wrong, echo=False)
    assert (found[0].name, found[0].status) == ("labels", "FAIL")


def test_a_first_loss_far_above_ln_c_is_said_in_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """doctor's "initial loss" check, on the batch fit already looks at (issue 37): a fresh
    classifier far from ln(C) is said in one warning line; a sane one, and a resumed or
    pretrained one below ln(C), says nothing."""
    import torch
    from torch import nn

    import glassloop

    torch.manual_seed(0)
    data = [(torch.randn(32, 6), torch.randint(0, 4, (32,)))]
    for scale, said in ((30.0, True), (1.0, False)):
        model = nn.Linear(6, 4)
        with torch.no_grad():
            model.weight.mul_(scale)  # over-confident from the start
        glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                          nn.CrossEntropyLoss(), progress="lines").fit(data, epochs=1)  # fmt: skip
        out = capsys.readouterr().out
        assert ("warning: the first batch's loss is" in out) is said, out
        if said:
            assert "over twice the ln(4) = 1.386 of an untrained classifier" in out


class _Cut(nn.Module):
    """A model with a layer its forward never uses and one whose gradient it zeroes; a
    zero-initialised branch (LoRA's B, a ReZero residual) whose inputs' gradients are zero
    at the first step only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.down = nn.Linear(6, 2, bias=False)  # LoRA's A: zero gradient at step 1 only
        self.up = nn.Linear(2, 3, bias=False)
        nn.init.zeros_(self.up.weight)  # LoRA's B
        self.unused = nn.Linear(4, 4)
        self.cut = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x).relu()) + self.up(self.down(x))
        return out + 0 * self.cut(x)  # (its gradient: always zero)


def test_weights_no_gradient_reaches_are_named_once_in_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """doctor's "gradient flow" check inside fit (issue 37, item 1): after a fresh run's first
    10 steps, one warning line names the weights that got no gradient (unused) or only zero
    ones (cut off); a zero-initialised adapter's A (a zero gradient at step 1) and frozen
    weights are not named; a resumed run and a healthy model say nothing."""
    import glassloop

    torch.manual_seed(0)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(12)]
    model = _Cut()
    model.body.bias.requires_grad_(False)  # frozen: not named
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none", run_dir=tmp_path / "r",
                                checkpoint=glassloop.CheckpointConfig(every_n_steps=5))  # fmt: skip
    trainer.fit(data, epochs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "gradients:" in line]
    assert lines == [
        "warning: gradients: in the first 10 steps, no gradient (unused by the forward) for "
        "'unused.weight', 'unused.bias'; an all-zero gradient for 'cut.weight', 'cut.bias': "
        "they have not learned yet; if they should, find what cuts them off (detach, a dead "
        "ReLU, a layer left out of forward, a learning rate of 0), else freeze them "
        "(requires_grad=False)"
    ]
    again = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              nn.CrossEntropyLoss(), progress="none", run_dir=tmp_path / "r",
                              checkpoint=glassloop.CheckpointConfig(every_n_steps=5))  # fmt: skip
    again.fit(data, epochs=2, resume="auto")  # a resumed run: checked before
    assert "gradients:" not in capsys.readouterr().out
    healthy = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    glassloop.Trainer(healthy, torch.optim.SGD(healthy.parameters(), lr=0.1),
                      nn.CrossEntropyLoss(), progress="none").fit(data, epochs=1)  # fmt: skip
    assert "gradients:" not in capsys.readouterr().out


def test_a_zero_initialised_adapter_trains_and_is_not_named() -> None:
    """LoRA's A gets a zero gradient at the first step (B starts at zero) and a real one from
    the second: the check waits for 10 steps before it names a weight."""
    from glassloop.step.gradient_flow import GradientFlow

    torch.manual_seed(0)
    model = _Cut()
    said: list[str] = []
    flow = GradientFlow(model, said.append)
    flow.start(fresh=True, sharded=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    zero_at_first = None
    for step in range(10):
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 0:
            zero_at_first = bool(model.down.weight.grad.abs().max() == 0)
        flow.check(optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert zero_at_first and not flow.pending
    assert len(said) == 1 and "'down.weight'" not in said[0] and "'cut.weight'" in said[0]


def test_train_accuracy_is_counted_as_it_trains_and_refused_where_it_means_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Keras's running accuracy (issue 37, item 10), opt-in: the epoch row's train_accuracy
    is the share of the labels each step's forward got right (a hand count here); a
    regression or a model computing its own loss is refused in one line."""
    import glassloop
    from glassloop.errors import ConfigError

    torch.manual_seed(0)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(5)]
    model = nn.Linear(6, 3)
    hand = nn.Linear(6, 3)
    hand.load_state_dict(model.state_dict())
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                nn.CrossEntropyLoss(), progress="lines",
                                train_accuracy=True)  # fmt: skip
    trainer.fit(data, epochs=2)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    for epoch in range(2):
        right = 0
        for x, y in data:
            out = hand(x)
            right += int((out.argmax(-1) == y).sum())
            nn.functional.cross_entropy(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert trainer.history[epoch]["train_accuracy"] == right / 80
    assert f"train_accuracy {100 * right / 80:.2f}%" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="train_accuracy counts a classifier's labels with a "
                       "loss function; this run's task is 'regression'"):  # fmt: skip
        glassloop.Trainer(nn.Linear(6, 1), torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.MSELoss(), train_accuracy=True)  # fmt: skip
    with pytest.raises(ConfigError, match="the model's own loss"):
        glassloop.Trainer(nn.Linear(6, 1), torch.optim.SGD(model.parameters(), lr=0.1), None,
                          task="classification", train_accuracy=True)  # fmt: skip


def test_the_bar_shows_running_accuracy_and_live_validation_numbers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's live numbers (issue 37, item 10): the training bar's running loss and
    accuracy, the last mid-epoch validation's val_loss/val_acc in it, and the validation
    bar's running numbers as it goes."""
    import time

    import glassloop
    from glassloop.tracking.console import ProgressReporter

    monkeypatch.setattr(ProgressReporter, "REFRESH_S", 0.0)
    monkeypatch.setattr(ProgressReporter, "VAL_REFRESH_S", 0.0)

    class Slow(nn.Linear):  # (each batch takes long enough for the bars to redraw)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.03)
            return super().forward(x)

    torch.manual_seed(0)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(12)]
    model = Slow(6, 3)
    glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      progress="bar", train_accuracy=True,
                      validate_every_n_steps=6).fit(data, data[:8], epochs=1)  # fmt: skip
    said = capsys.readouterr()
    bars = said.err
    # the mid-epoch validation's line: its own line above the bar, accuracy as the bar has it
    both = said.out + said.err
    line = next(part for part in re.split(r"[\r\n]", both) if "step 6: val_loss" in part)
    assert re.fullmatch(r"step 6: val_loss \d\.\d+, val_accuracy \d+\.\d\d%", line), line
    assert re.search(r"epoch 1/1.*loss=\d\.\d{4}, acc=\d+\.\d\d%", bars), bars[-2000:]
    assert re.search(r"acc=\d+\.\d\d%, val_loss=\d\.\d{4}, val_acc=\d+\.\d\d%", bars), bars
    assert re.search(r"validate.*val_loss=\d\.\d{4}, val_acc=\d+\.\d\d%", bars), bars


def test_train_accuracy_is_the_steps_first_forward_and_says_when_nothing_was_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(review of issue 37) LBFGS evaluates the model several times per step: the count is
    its first evaluation's, on the weights the reported loss is of; a train_step that never
    calls forward_backward counts nothing: NaN, said once."""
    import glassloop

    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 2, (32,))
    model = nn.Linear(6, 2)
    before = int((model(x).argmax(-1) == y).sum())
    trainer = glassloop.Trainer(model, torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5),
                                nn.CrossEntropyLoss(), progress="none",
                                train_accuracy=True)  # fmt: skip
    trainer.fit([(x, y)], epochs=1)
    assert trainer.history[0]["train_accuracy"] == before / 32
    assert before / 32 != float((model(x).argmax(-1) == y).float().mean())  # (it moved)

    class OwnStep(glassloop.Trainer):
        def train_step(self, window: Any) -> Any:
            (((inputs,), _), target), *_ = window
            loss = nn.functional.cross_entropy(self.model(inputs), target)
            loss.backward()
            self.step(self.optimizer, loss.detach())
            return loss.detach()

    other = nn.Linear(6, 2)
    OwnStep(other, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss(),
            progress="lines", train_accuracy=True).fit([(x, y)] * 3, epochs=2)  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("warning: train_accuracy: no training label was counted this epoch") == 1
    assert "train_accuracy nan%" in out
