"""Resume holes real programs hit: a loss edited between runs under the same name is said in
one line, as a config change is (before: resumed silently, the rest of the run trained on
another objective)."""

from __future__ import annotations

from pathlib import Path

from cli_runner import run_python

SCRIPT = """
import sys
import torch
from torch import nn
import glassloop
from my_loss import loss

torch.manual_seed(0)
model = nn.Linear(4, 3)
x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
data = [(x[i:i + 20], y[i:i + 20]) for i in range(0, 60, 20)]
trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss,
                            device="cpu", progress="none", run_dir="run")
try:
    trainer.fit(data, epochs=int(sys.argv[1]), resume="auto")
except glassloop.GlassloopError as err:
    print(err)
    sys.exit(2)
"""

LOSS = """
import torch.nn.functional as F

def loss(out, target):
    return F.cross_entropy(out, target, label_smoothing={smoothing})
"""


def test_a_loss_edited_between_runs_is_one_line_on_resume(tmp_path: Path) -> None:
    (tmp_path / "my_loss.py").write_text(LOSS.format(smoothing=0.0))
    script = SCRIPT.replace("sys.argv[1]", "EPOCHS")
    first = run_python(script.replace("EPOCHS", "1"), tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "my_loss.py").write_text(LOSS.format(smoothing=0.2))  # the same name, edited
    edited = run_python(script.replace("EPOCHS", "2"), tmp_path)
    assert edited.returncode == 2, edited.stderr
    (line,) = edited.stdout.strip().splitlines()
    assert "made with a different config: loss_fn_source_sha256: " in line
    assert "allow_config_change=True" in line
    (tmp_path / "my_loss.py").write_text(LOSS.format(smoothing=0.0))  # as it was: resumes
    again = run_python(script.replace("EPOCHS", "2"), tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from" in again.stdout + again.stderr
