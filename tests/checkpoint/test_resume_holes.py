"""Resume holes real programs hit: a loss edited between runs under the same name is said in
one line, as a config change is (before: resumed silently, the rest of the run trained on
another objective)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from cli_runner import cli, sets

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


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` as a script in a new process (forked: tests/forkserver.py) in ``cwd``."""
    (cwd / "example.py").write_text(code, encoding="utf-8")
    return forkserver.run([sys.executable, "example.py"], cwd=cwd, timeout=600)


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


def test_metric_files_with_bytes_that_are_not_utf8_still_resume(tmp_path: Path) -> None:
    """A disk error or an editor left bytes that are not UTF-8 in the run's metric files:
    every resume failed with a UnicodeDecodeError (sinks.truncate_rows). Now what is not a
    row is dropped and the rest kept, byte for byte."""
    import json

    import torch
    from torch import nn

    import glassloop

    def fit(epochs: int) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
        data = [(x[i : i + 20], y[i : i + 20]) for i in range(0, 40, 20)]
        glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.CrossEntropyLoss(), device="cpu", progress="none",
                          run_dir=tmp_path / "run").fit(data, data, epochs=epochs, resume="auto")  # fmt: skip

    fit(1)
    for name in ("metrics.jsonl", "metrics.csv"):
        with (tmp_path / "run" / name).open("ab") as handle:
            handle.write(b'\xff\xfe{"kind": "epoch", \x80\n')
    fit(2)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2]
    csv_rows = (tmp_path / "run" / "metrics.csv").read_bytes().splitlines()
    assert b"\xff" not in b"".join(csv_rows)  # (the damaged record dropped)
    assert [r.split(b",")[1] for r in csv_rows if r.startswith(b"epoch,")] == [b"1", b"2"]


# ------------------------------------------- a config change on resume: used, never only recorded
SMALL = [
    "data.name=synthetic", "data.num_samples=256", "data.num_features=8", "model.hidden=[16]",
    "train.progress=none", "data.batch_size=64",
]  # fmt: skip


def epoch_rates(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["lr"] for row in rows if row.get("kind") == "epoch"]


@pytest.mark.parametrize(
    "schedule",
    [
        ["scheduler.name=none"],
        ["scheduler.T_max=10"],  # (a recursion in torch; its closed form here)
        # (its span, recorded in config.json by the first run: given again, 3 epochs of 4)
        ["scheduler.name=warmup_cosine", "scheduler.warmup_steps=3", "scheduler.total_steps=12"],
        ["scheduler.name=StepLR", "scheduler.step_size=1", "scheduler.gamma=0.5"],
    ],
)
def test_a_learning_rate_or_a_schedule_changed_on_resume_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schedule: list[str]
) -> None:
    """``--allow-config-change --set optim.lr=...`` (and the schedule's length a change of
    epochs moves) trains with the new numbers from the resume on: the rows' rates are the
    straight run's with the new config, not the checkpoint's (before: the optimizer's saved
    parameter groups and the schedule's base rates won, while config.json said otherwise)."""
    spans = "scheduler.total_steps=12" in schedule
    base = sets([*SMALL, *schedule])
    straight, changed = tmp_path / "straight", tmp_path / "changed"
    new = sets(["optim.lr=0.003", "train.epochs=3", "optim.weight_decay=0.05"])
    assert cli(capsys, "train", *base, *new, "--run-dir", str(straight))[0] == 0
    first = sets(["optim.lr=0.001", "train.epochs=1", "scheduler.total_steps=4"][: 2 + spans])
    assert cli(capsys, "train", *base, *first, "--run-dir", str(changed))[0] == 0
    code, _, err = cli(
        capsys, "train", *base, *new, "--run-dir", str(changed), "--resume",
        "--allow-config-change",
    )  # fmt: skip
    assert code == 0, err
    assert epoch_rates(changed)[1:] == pytest.approx(epoch_rates(straight)[1:], rel=1e-9)
    saved = json.loads((changed / "config.json").read_text())
    assert saved["optim"]["lr"] == 0.003
    last = sorted((changed / "checkpoints").glob("step-*"))[-1]
    (group,) = json.loads((last / "state.json").read_text())["optimizer"]["param_groups"]
    assert group["weight_decay"] == 0.05  # (any optim key: the groups' own)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("optim.name=Adam", "optim.name"), ("train.seed=7", "train.seed"),
        ("scheduler.interval=step", "scheduler.interval"),
    ],
)  # fmt: skip
def test_a_change_the_checkpoint_would_override_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str, key: str
) -> None:
    run = tmp_path / "run"
    assert cli(capsys, "train", *sets([*SMALL, "train.epochs=1"]), "--run-dir", str(run))[0] == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = cli(
        capsys, "train", *sets([*SMALL, "train.epochs=2", change]), "--run-dir", str(run),
        "--resume", "--allow-config-change",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert f"config: {key} cannot change on resume" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
