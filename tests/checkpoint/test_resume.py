"""Exact resume: kill -9 (or SIGTERM) a real `glassloop train`, resume, compare bit for bit.

The model is a user model file that SIGKILLs its own process at a chosen training forward
call, so the kill lands at an exact step, in the middle of that step.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from safetensors.torch import load_file

from glassloop.step.throughput import TIMING

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_resume")

KILLABLE = Path(__file__).parents[1] / "killable_model.py"  # copied next to the config

# 480 training samples / batch 32 = 15 steps per epoch; 3 epochs = 45 steps. Shuffling,
# dropout, AdamW and a per-step cosine schedule; a checkpoint every 4 steps and per epoch.
CONFIG = """
[model]
target = "killable.py:KillableMLP"
[data]
name = "synthetic"
num_samples = 600
batch_size = 32
[scheduler]
interval = "step"
[train]
epochs = 3
progress = "lines"
log_every = 1
[checkpoint]
every_n_steps = 4
keep_last = 2
"""
FINAL = "checkpoints/step-00000045"


def glassloop(
    workdir: Path, run: str, *extra: str, kill_at: int = 0
) -> subprocess.CompletedProcess[str]:
    """``glassloop train cfg.toml --run-dir RUN ...`` in a new process (forked: torch is not
    imported again), SIGKILLed in training forward ``kill_at`` when that is set."""
    env = {**os.environ, "KILL_AT_FORWARD": str(kill_at)}
    return forkserver.run(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--run-dir", run, *extra],
        cwd=workdir,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resume")
    shutil.copy(KILLABLE, path / "killable.py")
    (path / "cfg.toml").write_text(CONFIG)
    result = glassloop(path, "reference")
    assert result.returncode == 0, result.stderr
    return path


def history(run: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # wall-clock fields are the only ones that may differ
        for key in TIMING:
            row.pop(key, None)
    return rows


def assert_same_run(a: Path, b: Path, final: str = FINAL) -> None:
    for name in ("model.safetensors", f"{final}/model.safetensors", f"{final}/state.safetensors"):
        ta, tb = load_file(a / name), load_file(b / name)
        assert ta.keys() == tb.keys(), name
        for key in ta:  # weights, optimizer moments and steps, RNG states, epoch losses
            assert torch.equal(ta[key], tb[key]), f"{name}:{key}"
    state_a = json.loads((a / final / "state.json").read_text())
    state_b = json.loads((b / final / "state.json").read_text())
    for state in (state_a, state_b):
        for row in state["history"]:  # wall-clock fields
            for key in TIMING:
                row.pop(key, None)
    assert state_a == state_b  # optimizer groups, scheduler, loop state, RNG, data position
    assert history(a) == history(b)  # every step and epoch row, once each


@pytest.mark.parametrize(
    ("case", "kills"),
    [
        ("mid-epoch", [14]),  # checkpoint at step 12, killed inside step 14
        ("epoch-boundary", [16]),  # killed in the first step of epoch 2 (checkpoint: step 15)
        ("twice", [7, 20]),  # killed at step 7 (resumes at 4), then 20 steps later (step 24)
    ],
)
def test_sigkill_and_resume_is_bitwise_identical(
    workdir: Path, case: str, kills: list[int]
) -> None:
    for kill_at in kills:
        killed = glassloop(
            workdir, case, *(["--resume"] if kill_at != kills[0] else []), kill_at=kill_at
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = glassloop(workdir, case, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert_same_run(workdir / "reference", workdir / case)


def test_sigkill_inside_an_accumulation_window(workdir: Path) -> None:
    accum = ("--set", "train.grad_accum_steps=3")  # 5 optimizer steps of 3 batches per epoch
    reference = glassloop(workdir, "accum-reference", *accum)
    assert reference.returncode == 0, reference.stderr
    # Checkpoint at step 4 (after batch 12); killed in batch 14, the second of step 5's window.
    killed = glassloop(workdir, "accum", *accum, kill_at=14)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = glassloop(workdir, "accum", "--resume", *accum)
    assert resumed.returncode == 0, resumed.stderr
    assert (
        "resumed from 'accum/checkpoints/step-00000004' at step 4 (epoch 1, batch 12)"
        in resumed.stdout
    )
    assert_same_run(workdir / "accum-reference", workdir / "accum", "checkpoints/step-00000015")


def test_a_stop_signal_to_the_process_group_with_workers_checkpoints_and_resumes(
    workdir: Path,
) -> None:
    """SIGUSR1 (Slurm's early warning: its default action would end the run unsaved) to the
    whole group, as SIGTERM (the same path; SIGTERM itself: test_verify_resume_signals.py,
    test_distributed.py): the workers ignore it, the run checkpoints and stops with 128 + the
    signal, and resumes to the reference."""
    stop = signal.SIGUSR1
    workers = ("--set", "data.num_workers=2")
    proc = forkserver.Popen(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "term", *workers],
        cwd=workdir,
        start_new_session=True,  # its own process group, like a job under a scheduler
    )
    assert proc.stdout is not None
    lines = 0
    for line in proc.stdout:
        lines += line.startswith("loss:")
        if lines == 20:  # in epoch 2, workers running
            os.killpg(proc.pid, stop)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + stop, err
    assert f"stopped by {stop.name} after step" in err and "checkpoint saved to" in err
    step = int(err.split("after step ")[1].split(";")[0])
    assert (workdir / "term" / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    # The command the stop prints, pasted as a user would: --resume alone reads the run's
    # own config.json (data.num_workers=2 included); cfg.toml is not named.
    hint = "; continue with: glassloop train --run-dir term --resume --trust-code\n"
    assert err.endswith(hint), err
    resumed = forkserver.run(
        [sys.executable, "-m", *shlex.split(hint.split(": ")[1])], cwd=workdir, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming with the run's own config: term/config.json" in resumed.stdout
    # Workers do not change the data order: the result equals the num_workers=0 reference.
    assert_same_run(workdir / "reference", workdir / "term")


def test_resuming_a_finished_run_says_so_and_exits_0(workdir: Path) -> None:
    result = glassloop(workdir, "reference", "--resume")
    assert result.returncode == 0, result.stderr
    assert "run already finished at step 45 (epoch 3/3); nothing to do" in result.stdout


def test_changed_config_is_refused_with_the_differences(workdir: Path) -> None:
    result = glassloop(
        workdir, "reference", "--resume", "--set", "optim.lr=0.01", "--set", "data.batch_size=16"
    )
    assert result.returncode == 2
    assert (
        "data.batch_size: 32 -> 16" in result.stderr and "optim.lr: 0.001 -> 0.01" in result.stderr
    )
    assert "--allow-config-change" in result.stderr


def test_a_run_dir_with_checkpoints_is_not_overwritten_without_resume(workdir: Path) -> None:
    before = (workdir / "reference" / "model.safetensors").read_bytes()
    result = glassloop(workdir, "reference")
    assert result.returncode == 2
    assert "already holds checkpoints; pass resume='auto' (--resume)" in result.stderr
    assert (workdir / "reference" / "model.safetensors").read_bytes() == before


def test_keep_last_prunes_only_our_checkpoints(workdir: Path) -> None:
    names = sorted(p.name for p in (workdir / "reference" / "checkpoints").iterdir())
    assert names == ["latest", "step-00000044", "step-00000045"]


def test_a_resume_from_an_epochs_last_step_says_nothing_of_the_scheduler(workdir: Path) -> None:
    """A checkpoint at an epoch's last step comes before that epoch's scheduler step: the
    resumed process steps the scheduler first, and torch warned "lr_scheduler.step() before
    optimizer.step()" (the optimizer had stepped, in the process before)."""
    per_epoch = (
        "--set",
        "scheduler.name=StepLR",
        "--set",
        "scheduler.step_size=1",
        "--set",
        "scheduler.interval=epoch",
        "--set",
        "checkpoint.every_n_steps=5",
        "--set",
        "checkpoint.every_n_epochs=0",
    )
    killed = glassloop(workdir, "last-step", *per_epoch, kill_at=16)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = glassloop(workdir, "last-step", "--resume", *per_epoch)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 15 (epoch 1, batch 15)" in resumed.stdout
    assert "lr_scheduler" not in resumed.stderr, resumed.stderr
