"""glassloop doctor: each classic mistake gives its FAIL; a healthy setup passes."""

from __future__ import annotations

from pathlib import Path

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


def test_the_python_doctor_runs_the_checks_on_a_trainer_and_leaves_it_as_it_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

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
