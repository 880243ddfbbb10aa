"""glassloop doctor: each classic mistake gives its FAIL; a healthy setup passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_glassloop

from glassloop import load_config
from glassloop.checklist import run_doctor

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
