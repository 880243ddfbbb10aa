"""The glassloop command end to end, and every user error: one line, exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_glassloop

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_cli")

FAST = ["--set", "train.epochs=2", "--set", "train.progress=lines"]


def glassloop(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_glassloop(*args, cwd=cwd)


def assert_user_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert message in lines[0], lines[0]


@pytest.fixture(scope="module")
def trained_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    return run_dir, glassloop("train", *FAST, "--run-dir", str(run_dir))


def test_train_on_bundled_mnist_writes_the_run_dir(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, result = trained_run
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "loss: " in out and "[   64/ 4000]" in out
    assert "epoch 2/2  train_loss" in out
    accuracy = float(out.split("final validation accuracy: ")[1].split("%")[0])
    assert accuracy >= 85.0  # two epochs of the demo; ten reach >= 90% (make demo)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["name"] == "mnist-5k" and config["train"]["epochs"] == 2
    assert config["scheduler"]["T_max"] == 2  # resolved: the cosine spans the run
    run_info = json.loads((run_dir / "run.json").read_text())
    assert run_info["status"] == "finished" and run_info["torch"]
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert header.startswith("kind,epoch,step,samples,train_loss,val_loss,val_accuracy")
    assert (run_dir / "model.safetensors").stat().st_size > 2_000_000


def test_eval_prints_the_same_accuracy_and_a_report(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, train = trained_run
    result = glassloop("eval", str(run_dir))
    assert result.returncode == 0, result.stderr
    trained = train.stdout.split("final validation accuracy: ")[1].split("%")[0]
    assert f"accuracy: {trained}%" in result.stdout
    assert "precision" in result.stdout and "weighted avg" in result.stdout
    assert len([line for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]) == 10


def test_help_documents_every_flag() -> None:
    result = glassloop("train", "--help")
    assert result.returncode == 0
    for flag in ("--set", "--run-dir", "CONFIG"):
        assert flag in result.stdout
    # every exit code, where a user of each command looks (train --help lacked them, and the
    # main --help lacked 5)
    for command in ([], ["train"], ["verify-resume"]):
        shown = glassloop(*command, "--help").stdout
        codes = shown.split("exit codes:\n")[1].splitlines()
        assert [line.split()[0] for line in codes[:8]] == ["0", "1", "2", "3", "4", "5", "128+N"]


def write_model(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "optim.learning_rate=1"],
            "config: unknown key 'optim.learning_rate' (did you mean 'optim.lr'?)",
        ),
        (["--set", "train.epochs=two"], "config: train.epochs must be an integer, got 'two'"),
        (["missing.toml"], "config: file 'missing.toml' not found"),
        (
            ["--set", "model.target=no_such_pkg.models:Net"],
            "could not be imported: ModuleNotFoundError",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (
            ["--set", "data.name=mnist", "--set", "data.download=true"],
            "needs torchvision: pip install 'glassloop[vision]'",
        ),
        (["--set", "data.name=cifar10"], "cifar10 files not found: extract the binary version"),
    ],
)
def test_config_errors_are_one_line_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    result = glassloop("train", *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_user_error(result, message)
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


def test_labels_out_of_range(tmp_path: Path) -> None:
    model = write_model(
        tmp_path, "def Net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 5))\n"
    )
    result = glassloop(
        "train", *FAST, "--set", f"model.target={model}:Net", "--run-dir", str(tmp_path / "r")
    )
    assert_user_error(
        result, "labels in the first training batch range over [0, 9] but the model has 5 outputs"
    )


def test_first_batch_rejected_names_the_data_shape(tmp_path: Path) -> None:
    model = write_model(
        tmp_path, "def Net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(100, 10))\n"
    )
    result = glassloop(
        "train", *FAST, "--set", f"model.target={model}:Net", "--run-dir", str(tmp_path / "r")
    )
    assert_user_error(
        result, "model: the first batch ((64, 1, 28, 28) float32, (64,) int64) was rejected"
    )
    assert "64x784 and 100x10" in result.stderr


def test_empty_dataset(tmp_path: Path) -> None:
    path = tmp_path / "empty.npz"
    np.savez(path, x=np.zeros((0, 4), np.float32), y=np.zeros((0,), np.int64))
    result = glassloop(
        "train",
        *FAST,
        "--set",
        "data.name=npz",
        "--set",
        f"data.path={path}",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert_user_error(result, "holds an empty dataset")


def test_npz_training_end_to_end(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    x = (np.eye(3)[y] * 3 + rng.normal(size=(300, 3))).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    result = glassloop(
        "train",
        *FAST,
        "--set",
        "data.name=npz",
        "--set",
        f"data.path={tmp_path / 'd.npz'}",
        "--set",
        "model.hidden=[16]",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert result.returncode == 0, result.stderr
    assert "final validation accuracy" in result.stdout


def test_eval_of_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    assert_user_error(glassloop("eval", str(tmp_path)), "is not a run directory")


def test_a_run_config_reruns_the_run(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, _ = trained_run
    result = glassloop(
        "train",
        str(run_dir / "config.json"),
        "--set",
        "train.epochs=1",
        "--set",
        "train.progress=none",
        "--run-dir",
        str(tmp_path / "again"),
    )
    assert result.returncode == 0, result.stderr
    first = json.loads((run_dir / "config.json").read_text())
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    first["train"]["epochs"] = again["train"]["epochs"] = 0
    first["train"]["progress"] = again["train"]["progress"] = ""
    first["scheduler"]["T_max"] = again["scheduler"]["T_max"] = 0
    assert first == again


def test_export_then_eval_and_load_model(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, train = trained_run
    out = tmp_path / "exported.safetensors"
    result = glassloop("export", str(run_dir), "--output", str(out))
    assert result.returncode == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
        assert not any(key.startswith(("module.", "_orig_mod.")) for key in handle.keys())  # noqa: SIM118
    assert json.loads(metadata["glassloop.model"])["input_shape"] == [1, 28, 28]
    trained = train.stdout.split("final validation accuracy: ")[1].split("%")[0]
    for source in (out, run_dir / "checkpoints" / "step-00000126"):
        evaluated = glassloop("eval", str(source))
        assert evaluated.returncode == 0, evaluated.stderr
        assert f"accuracy: {trained}%" in evaluated.stdout

    import glassloop as gl

    model = gl.load_model(out)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == 669_706


def test_eval_refuses_a_pickle_file(tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    assert_user_error(glassloop("eval", str(tmp_path / "model.pt")), "not a valid safetensors file")


def test_text_classification_through_the_cli(tmp_path: Path) -> None:
    lines = ["text,label"]
    for i in range(200):
        cue = "wonderful" if i % 2 else "dreadful"
        lines.append(f"the film was {'really ' * (i % 5)}{cue},{'pos' if i % 2 else 'neg'}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    result = glassloop(
        "train",
        "--set",
        "data.name=text-csv",
        "--set",
        f"data.path={tmp_path / 't.csv'}",
        "--set",
        "model.name=text-classifier",
        "--set",
        "train.epochs=4",
        "--set",
        "data.batch_size=16",
        "--set",
        "optim.lr=0.01",
        "--set",
        "train.progress=none",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    evaluated = glassloop("eval", str(run_dir))
    assert evaluated.returncode == 0, evaluated.stderr
    assert "accuracy: 100.00%" in evaluated.stdout and "pos" in evaluated.stdout


def test_predict_on_pngs_and_arrays_matches_the_trained_model(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    import torch
    from PIL import Image

    import glassloop as gl
    from glassloop.data.datasets import MNIST_MEAN, MNIST_STD, load_mnist_5k_arrays

    run_dir, _ = trained_run
    x, _ = load_mnist_5k_arrays()
    raw = x[:3].reshape(3, 28, 28)
    for i in range(3):
        Image.fromarray(raw[i]).save(tmp_path / f"digit{i}.png")
    np.save(tmp_path / "digits.npy", raw.astype(np.float32))
    result = glassloop(
        "predict",
        str(run_dir),
        *(str(tmp_path / f"digit{i}.png") for i in range(3)),
        str(tmp_path / "digits.npy"),
        "--top-k",
        "2",
        "--output",
        str(tmp_path / "preds.csv"),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 + 3 + 1  # three PNGs, three array rows, "wrote ..."
    assert lines[0].startswith(f"{tmp_path / 'digit0.png'}: ")
    rows = (tmp_path / "preds.csv").read_text().splitlines()
    assert rows[0] == "input,rank,class,probability" and len(rows) == 1 + 6 * 2

    predictor = gl.Predictor.from_path(run_dir)
    probs = predictor.predict(raw[0])  # one example: the batch dimension is added
    model = gl.load_model(run_dir / "model.safetensors")
    normalised = (torch.tensor(raw[:1], dtype=torch.float32) / 255 - MNIST_MEAN) / MNIST_STD
    expected = torch.softmax(model(normalised.view(1, 1, 28, 28)), dim=1).detach()
    assert torch.allclose(probs, expected, atol=1e-6)
    png_class = lines[0].split(": ")[1].split(" ")[0]
    assert int(png_class) == int(expected.argmax())


def test_predict_bad_inputs_are_clear_errors(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, _ = trained_run
    np.save(tmp_path / "wrong.npy", np.zeros((2, 5), np.float32))
    assert_user_error(
        glassloop("predict", str(run_dir), str(tmp_path / "wrong.npy")),
        "does not fit the model's input (1, 28, 28)",
    )
    (tmp_path / "broken.png").write_bytes(b"not an image")
    assert_user_error(
        glassloop("predict", str(run_dir), str(tmp_path / "broken.png")), "cannot read image"
    )
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    assert_user_error(
        glassloop("predict", str(run_dir), str(tmp_path / "rows.csv")),
        "has 2 columns, the model takes 784 features",
    )


def test_runs_lists_status_step_and_best(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run_dir, train = trained_run
    killed = run_dir.parent / "killed"
    killed.mkdir(exist_ok=True)
    (killed / "run.json").write_text(json.dumps({"status": "running", "step": 7, "epoch": 0}))
    failed = run_dir.parent / "failed"
    failed.mkdir(exist_ok=True)
    (failed / "run.json").write_text(json.dumps({
        "status": "failed", "step": 3, "epoch": 0, "error": "DataError: data: bad labels",
        "started": "2026-01-02T10:00:00+0000", "ended": "2026-01-02T10:03:12+0000",
    }))  # fmt: skip
    result = glassloop("runs", str(run_dir.parent))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", "status", "step", "epoch", "time", "final", "best"]
    order = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]
    # newest first: killed (no start time: its run.json was written just now), the trained
    # run (started minutes ago), the failed one (January)
    assert order.index(str(killed)) < order.index(str(run_dir)) < order.index(str(failed))
    failed_at = next(i for i, line in enumerate(lines) if line.startswith(str(failed)))
    assert " 3m 12s " in lines[failed_at]
    assert lines[failed_at + 1] == "  error: DataError: data: bad labels"
    finished = next(line for line in lines if line.startswith(str(run_dir)))
    accuracy = train.stdout.split("final validation accuracy: ")[1].split("%")[0]
    assert "finished" in finished and " 126 " in finished and "val_accuracy" in finished
    assert float(finished.split("val_accuracy ")[1].split("%")[0]) >= float(accuracy)
    assert "running or killed" in next(line for line in lines if line.startswith(str(killed)))
    assert_user_error(glassloop("runs", str(tmp_path / "nope")), "is not a directory")


def test_train_writes_a_report_and_report_rewrites_it(
    trained_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, train = trained_run
    assert f"report: {run_dir / 'report' / 'index.html'}" in train.stdout
    (run_dir / "report" / "confusion.png").unlink()
    result = glassloop("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert (run_dir / "report" / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    assert_user_error(glassloop("report", str(run_dir / "nope")), "is not a run directory")
    # A row a callback wrote a list, a table or a string into is drawn without them (a list
    # crashed the report with a TypeError).
    copied = run_dir.parent / "copied"
    shutil.copytree(run_dir, copied)
    rows = [json.loads(line) for line in (copied / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.update(val_tags=[1, 2], lr=[0.1], val_note="x", val_table={"a": 1})
    (copied / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = glassloop("report", str(copied))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["runs"], ["config"]])
def test_a_reader_that_went_away_is_a_normal_end(tmp_path: Path, command: list[str]) -> None:
    """`glassloop runs | head -1`: head exits, the next write finds the pipe closed. That
    ends the command with 0 and nothing on stderr, not a BrokenPipeError traceback (issue
    37). The pipe is closed before the command writes, so the write always fails."""
    import os
    import sys

    read, write = os.pipe()
    os.close(read)  # (the reader is gone before the first line)
    args = [*command, str(tmp_path)] if command == ["runs"] else command
    done = subprocess.run(
        [sys.executable, "-m", "glassloop", *args], stdout=write, stderr=subprocess.PIPE,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_labels_that_start_at_1_are_named_in_one_line(tmp_path: Path) -> None:
    """npz labels 1..3: the built-in model gets 4 outputs and class 0 no sample; the run
    says so in one line instead of training silently (issue 37)."""
    rng = np.random.default_rng(0)
    y = rng.integers(1, 4, 90)
    x = (np.eye(4)[y] * 3 + rng.normal(size=(90, 4))).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    sets = ["--set", "data.name=npz", "--set", f"data.path={tmp_path / 'd.npz'}"]
    result = glassloop("train", *FAST, *sets, "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    said = (
        "warning: data: classes [0] have no training samples (labels 1..3, 4 outputs): they "
        "can never be learned; labels that start at 1 need 1 subtracted"
    )
    lines = result.stdout.splitlines()
    # before the header, and again at the end, where it is still on the screen
    assert lines.count(said) == 2 and lines.index(said) < 3 and said in lines[-2:], lines


def test_a_terminal_sees_a_first_line_before_torch_is_imported(tmp_path: Path) -> None:
    """Seconds of silence before the header looked hung (issue 37): on a terminal the first
    line comes before the heavy imports. A real process, its stderr a pseudo-terminal."""
    import os
    import pty
    import sys

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "glassloop", "train", "--fast-dev-run", "--set",
         "data.name=synthetic", "--set", "train.progress=none"],  # (no bar on the terminal)
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=follower, text=True,
    )  # fmt: skip
    os.close(follower)
    first = os.read(leader, 200).decode()
    assert first.startswith("glassloop: starting (importing torch"), first
    out, _ = proc.communicate(timeout=120)
    os.close(leader)
    assert proc.returncode == 0 and "fast dev run: ok" in out


def test_the_line_a_stopped_run_ends_with_holds_no_secret() -> None:
    """The resume command it prints names the run directory: a URL's credentials are
    replaced by ***, as in every other line (the one redaction)."""
    import argparse

    from glassloop.cli.main import stopped_line
    from glassloop.distributed.preemption import Preempted

    args = argparse.Namespace(run_dir="s3://AKIAKEY:s3cr3t@bucket/run", nproc=2)
    stop = Preempted(15, 7, "/home/u/.cache/glassloop/remote/run/checkpoints/step-00000007")
    line = stopped_line(args, stop)
    assert "s3cr3t" not in line and "AKIAKEY" not in line, line
    assert line.startswith("glassloop: stopped by SIGTERM after step 7; checkpoint saved to ")
    assert line.endswith("; continue with: glassloop train --run-dir s3://***@bucket/run "
                         "--nproc 2 --resume")  # fmt: skip


def test_a_ctrl_c_says_whether_anything_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the first step (imports, data, the model) nothing has been saved; in training
    without SIGINT among train.stop_signals the moment is not saved but earlier ones are."""
    import glassloop
    import glassloop.config.assemble

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    small = ["--set", "data.name=synthetic", "--set", "train.epochs=1", "--run-dir", "r"]
    with monkeypatch.context() as patch:
        patch.setattr(glassloop.config.assemble, "build", interrupt)
        early = run_glassloop("train", *small, cwd=tmp_path)
    assert early.returncode == 130
    said = "glassloop: interrupted during start-up, before the first step: nothing was saved yet"
    assert early.stderr.strip() == said
    monkeypatch.setattr(glassloop.Trainer, "train_step", interrupt)
    late = run_glassloop("train", *small, "--set", 'train.stop_signals=["TERM"]', cwd=tmp_path)
    assert late.returncode == 130 and late.stderr.strip().endswith(
        "glassloop: interrupted during training (SIGINT is not in train.stop_signals): this "
        "moment was not saved; the checkpoints saved before it are intact"
    ), late.stderr
