"""glassloop doctor: each classic mistake gives its FAIL; a healthy setup passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_glassloop

from glassloop import load_config
from glassloop.doctor import run_doctor

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
