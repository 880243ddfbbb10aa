"""glassloop tune: a bad space is one line before any trial; a sweep killed with kill -9 and
run again ends with its N trials, the killed trial resumed from its checkpoint (each epoch
once, its weights those of a straight run of its config.json, bit for bit); a median pruner
stops a trial that falls behind, and run.json says so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from cli_runner import run_glassloop
from safetensors.torch import load_file

from glassloop.tuning.sweep import Sweep

BASE = """
[data]
name = "synthetic"
num_samples = 2048
num_features = 4
batch_size = 16
[model]
hidden = [32]
[train]
epochs = 8
progress = "none"
"""
SPACE = """
[space]
"optim.lr" = { low = 1e-3, high = 1e-1, log = true }
"model.hidden" = { choices = [[32], [16, 16]] }
"""


def write(folder: Path, base: str = BASE, space: str = SPACE) -> tuple[Path, Path]:
    (folder / "base.toml").write_text(base, encoding="utf-8")
    (folder / "space.toml").write_text(space, encoding="utf-8")
    return folder / "base.toml", folder / "space.toml"


def epochs_of(run: Path) -> list[int]:
    rows = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [row["epoch"] for row in map(json.loads, rows) if row["kind"] == "epoch"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            '"optim.learning_rate" = { low = 1e-4, high = 1e-1 }',
            "'optim.learning_rate' low = 0.0001: config: unknown key 'optim.learning_rate' "
            "(did you mean 'optim.lr'?)",
        ),
        ('"optim.lr" = { low = -1.0, high = 0.1 }', "optim.lr must be > 0, got -1.0"),
        ('"optim.lr" = { low = 0.1, high = 0.01 }', "low must be below high"),
        (
            '"optim.weight_decay" = { low = 0.0, high = 0.1, log = true }',
            "'optim.weight_decay': `low > 0` must hold for `log=True`, but got (low=0.0, high=0.1)",
        ),
        (
            '"train.precision" = { choices = ["32", "fp64"] }',
            "choice \"fp64\": config: train.precision must be one of 32, bf16, fp16; got 'fp64'",
        ),
    ],
)
def test_a_bad_space_is_one_line_before_any_trial(tmp_path: Path, entry: str, message: str) -> None:
    config, space = write(tmp_path, space=f"[space]\n{entry}\n")
    sweep = tmp_path / "sweep"
    done = run_glassloop(
        "tune", str(config), "--space", str(space), "--trials", "2", "--sweep-dir", str(sweep)
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stdout == "" and not sweep.exists()


def tune_command(folder: Path, trials: int, workers: int) -> list[str]:
    config, space = folder / "base.toml", folder / "space.toml"
    sweep = ["--sweep-dir", str(folder / "sweep"), "--workers", str(workers)]
    return ["tune", str(config), "--space", str(space), "--trials", str(trials), *sweep]


def start_sweep(command: list[str], output: int) -> subprocess.Popen[str]:
    """The sweep in a process group of its own (a kill of the group takes its trials too)."""
    return subprocess.Popen([sys.executable, "-m", "glassloop", *command], stdout=output,
                            stderr=output, text=True, start_new_session=True)  # fmt: skip


def wait_for_a_checkpoint_mid_run(sweep: Path, proc: subprocess.Popen[str]) -> Path:
    """A trial that has saved a checkpoint and is still training (its run.json: running)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before a trial had a checkpoint mid-run"
        for run in sorted(sweep.glob("trial-*/")):
            status = (
                json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
            )
            if (run / "checkpoints" / "latest").is_file() and status.get("status") == "running":
                return run
        time.sleep(0.02)
    raise AssertionError("no trial had a checkpoint and was still running within 60 s")


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A sweep of 3 trials, 2 at a time, killed (kill -9 of its process group) while a trial
    is mid-run, then the same command again: (the folder, the killed trial, its output)."""
    folder = tmp_path_factory.mktemp("tune")
    write(folder)
    command = tune_command(folder, trials=3, workers=2)
    proc = start_sweep(command, subprocess.DEVNULL)
    try:
        killed = wait_for_a_checkpoint_mid_run(folder / "sweep", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    done = run_glassloop(*command)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder, killed, done.stdout


def test_a_killed_sweep_ends_with_its_trials_and_names_the_best(
    killed_and_resumed: tuple[Path, Path, str],
) -> None:
    folder, _, out = killed_and_resumed
    storage = f"sqlite:///{folder / 'sweep' / 'study.db'}"
    study = optuna.load_study(study_name="glassloop", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert len({str(t.params) for t in study.trials}) == 3  # (continued: no trial drawn again)
    best = study.best_trial
    config = folder / "sweep" / f"trial-{best.number:04d}" / "config.json"
    last = out.splitlines()[-2:]
    assert last[0].startswith(f"best trial: {best.number}, val_loss {best.value:.6g}"), out
    assert last[1].startswith(f"its config: {config}"), out
    assert all(
        epochs_of(folder / "sweep" / f"trial-{n:04d}") == list(range(1, 9)) for n in range(3)
    )
    # The report: the history, each parameter against the metric, a row per trial.
    index = folder / "sweep" / "report" / "index.html"
    assert f"report: {index}" in out, out
    page = index.read_text()
    assert page.count("<tr>") == 4 and f"{best.value:.6g}" in page, page
    for image in ("history.png", "param-1.png", "param-2.png"):
        assert f'src="{image}"' in page and (index.parent / image).read_bytes()[:4] == b"\x89PNG"


def test_the_killed_trial_was_resumed_and_its_config_reproduces_it(
    killed_and_resumed: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Not restarted: each epoch once, and the weights of a straight run of its config.json."""
    _, killed, out = killed_and_resumed
    number = int(killed.name.removeprefix("trial-"))
    assert f"trial {number}: resumed from its newest checkpoint ({killed})" in out, out
    log = killed.with_name(f"{killed.name}.log").read_text(encoding="utf-8")
    resumed = re.search(r"resumed from '.*checkpoints/step-\d+' at step (\d+)", log)
    assert resumed is not None and int(resumed[1]) > 0, log
    assert epochs_of(killed) == list(range(1, 9))
    straight = tmp_path / "straight"
    done = run_glassloop("train", str(killed / "config.json"), "--run-dir", str(straight))
    assert done.returncode == 0, done.stderr
    ours, theirs = weights(killed / "model.safetensors"), weights(straight / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_the_median_pruner_stops_a_trial_that_falls_behind(tmp_path: Path) -> None:
    """lr 1e-9 learns nothing: behind the median of the trials before it at epoch 1, it is
    stopped (SIGTERM: a checkpoint) long before its 8 epochs. train.seed 10: the sampler's
    first two draws are 0.05, then 1e-9."""
    space = (
        'pruner = { name = "median", n_startup_trials = 1, n_warmup_steps = 0 }\n'
        '[space]\n"optim.lr" = { choices = [0.05, 1e-9] }\n'
    )
    write(tmp_path, base=BASE + "seed = 10\n", space=space)
    done = run_glassloop(*tune_command(tmp_path, trials=2, workers=1))
    assert done.returncode == 0, done.stdout + done.stderr
    sweep = tmp_path / "sweep"
    study = optuna.load_study(study_name="glassloop", storage=f"sqlite:///{sweep / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"], done.stdout
    assert study.trials[1].params == {"optim.lr": "1e-09"}
    pruned = sweep / "trial-0001"
    assert json.loads((pruned / "run.json").read_text())["status"] == "pruned"
    assert len(epochs_of(pruned)) < 8 and (pruned / "checkpoints" / "latest").is_file()
    assert "trial 1: pruned at epoch 1" in done.stdout
    # glassloop runs DIR: a row per trial, its status, its last epoch's metric, its values
    listed = run_glassloop("runs", str(sweep)).stdout.splitlines()
    rows = [(t.number, t.intermediate_values[max(t.intermediate_values)]) for t in study.trials]
    assert [line.split() for line in listed] == [
        ["trial", "status", "epoch", "val_loss", "params"],
        ["trial-0000", "finished", "8", f"{rows[0][1]:.4g}", "optim.lr=0.05"],
        [
            "trial-0001",
            "pruned",
            str(len(epochs_of(pruned))),
            f"{rows[1][1]:.4g}",
            "optim.lr=1e-09",
        ],
    ], listed


def test_sigterm_stops_the_trials_with_a_checkpoint_and_prints_the_continue_command(
    tmp_path: Path,
) -> None:
    """The sweep's stop: each running trial gets one SIGTERM (it saves a checkpoint, run.json
    "interrupted"), stays running in the study for the same command to resume; exit 143."""
    write(tmp_path)
    command = tune_command(tmp_path, trials=2, workers=1)
    proc = start_sweep(command, subprocess.PIPE)
    try:
        run = wait_for_a_checkpoint_mid_run(tmp_path / "sweep", proc)
        proc.send_signal(signal.SIGTERM)  # (the sweep alone: it stops its trials)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert f"glassloop: continue the sweep with: glassloop {' '.join(command)}" in err, err
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    storage = f"sqlite:///{tmp_path / 'sweep' / 'study.db'}"
    study = optuna.load_study(study_name="glassloop", storage=storage)
    assert [t.state.name for t in study.trials] == ["RUNNING"]


def test_without_optuna_tune_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path)
    monkeypatch.setitem(sys.modules, "optuna", None)  # (import optuna: ImportError)
    done = run_glassloop(*tune_command(tmp_path, trials=1, workers=1))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "pip install 'glassloop[search]'" in done.stderr
    probe = "import sys; from glassloop.cli.main import make_parser; print('optuna' in sys.modules)"
    help_only = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert help_only.stdout.strip() == "False"


def test_a_killed_trial_resumes_trusted_only_with_the_sweeps_own_model(tmp_path: Path) -> None:
    """A trial of a sweep whose config names a model class resumes with --trust-code (its
    config.json names that class); a trial folder naming other code gets no trust, and
    train refuses it in one line."""
    sweep = Sweep(None, None, None, ["model.target=net.py:Net"], tmp_path, print)  # type: ignore[arg-type]
    run = tmp_path / "trial-0000"
    run.mkdir()
    for target, expected in (("net.py:Net", ["--trust-code"]), ("subprocess:Popen", [])):
        (run / "config.json").write_text(json.dumps({"model": {"target": target}}))
        assert sweep._trust(run) == expected


def test_the_runs_listing_reads_a_nested_key_from_each_trials_config(tmp_path: Path) -> None:
    """``glassloop runs SWEEP_DIR`` with a searched key under model.kwargs (a sweep over a
    model of one's own), read from each trial's config.json."""
    sweep = tmp_path / "sweep"
    (sweep / "trial-0000").mkdir(parents=True)
    keys = ["model.kwargs.width", "optim.lr"]
    (sweep / "sweep.json").write_text(json.dumps({"metric": "val_loss", "keys": keys}))
    config = {"model": {"kwargs": {"width": 48}}, "optim": {"lr": 0.01}}
    (sweep / "trial-0000" / "config.json").write_text(json.dumps(config))
    (sweep / "trial-0000" / "run.json").write_text(json.dumps({"status": "finished"}))
    row = {"kind": "epoch", "epoch": 1, "step": 4, "val_loss": 0.25}
    (sweep / "trial-0000" / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    listed = run_glassloop("runs", str(sweep)).stdout.splitlines()
    assert listed[1].split() == [
        "trial-0000", "finished", "1", "0.25", "model.kwargs.width=48,", "optim.lr=0.01"
    ], listed  # fmt: skip
