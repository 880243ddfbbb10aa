"""Reports (PNG plots + index.html) and the TensorBoard sink."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

from glassloop import build, load_config
from glassloop.tracking.report import write_report


def test_report_files_exist_and_decode_and_tensorboard_reads_back(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "data.name=synthetic", "model.hidden=[16]", "train.epochs=3", "train.progress=none",
        "train.tensorboard=true", "train.log_every=5",
    ])  # fmt: skip
    run = build(cfg, run_dir=tmp_path)
    run.trainer.fit(run.train_loader, run.val_loader, epochs=3)
    index = write_report(
        tmp_path, evaluation=run.trainer.last_eval, class_names=run.splits.class_names
    )
    page = index.read_text()
    referenced = re.findall(r'<img src="([^"]+)"', page)
    assert set(referenced) == {
        "loss.png",
        "step_loss.png",
        "val_accuracy.png",
        "lr.png",
        "confusion.png",
    }
    for name in referenced:
        with Image.open(index.parent / name) as image:  # a real, decodable PNG
            assert image.format == "PNG" and image.size[0] > 100
    assert "weighted avg" in (index.parent / "classification_report.txt").read_text()
    assert "Final metrics" in page and "val_accuracy" in page and "torch" in page

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"epoch/train_loss", "epoch/val_accuracy", "step/loss", "step/lr"} <= tags
    epochs = [e.step for e in events.Scalars("epoch/val_loss")]
    assert epochs == [1, 2, 3]
    history = [row["val_loss"] for row in run.trainer.history]
    logged = [e.value for e in events.Scalars("epoch/val_loss")]  # stored as float32
    assert all(abs(a - b) < 1e-5 for a, b in zip(logged, history, strict=True))


def test_the_report_a_finished_run_writes_says_finished_and_how_long() -> None:
    """The report written at the end of every run said "running or killed" and time "-"
    (it was written before run.json recorded the end), until `glassloop report` ran again."""
    import tempfile

    from cli_runner import run_glassloop

    from glassloop.tracking.runs import summarise

    for how in ("cli", "python"):
        run_dir = Path(tempfile.mkdtemp()) / "run"
        settings = ["data.name=synthetic", "model.hidden=[8]", "train.epochs=1",
                    "train.progress=none"]  # fmt: skip
        if how == "cli":
            args = [arg for s in settings for arg in ("--set", s)]
            assert run_glassloop("train", *args, "--run-dir", str(run_dir)).returncode == 0
        else:
            run = build(load_config(None, settings), run_dir=run_dir)
            run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
        page = (run_dir / "report" / "index.html").read_text()
        summary = summarise(run_dir)
        assert summary is not None and summary.status == "finished"
        facts = dict(re.findall(r"<tr><td>(status|training time)</td><td>([^<]*)</td></tr>", page))
        assert facts == {"status": "finished", "training time": summary.duration}, (how, facts)
        assert summary.duration != "-"


def test_best_means_checkpoint_monitor_everywhere(tmp_path: Path) -> None:
    """The end summary and the report said best val_loss, `glassloop runs` best
    val_accuracy, sometimes at different epochs."""
    import json

    from glassloop.best import best_epoch
    from glassloop.tracking.runs import summarise

    rows = [
        {"kind": "epoch", "epoch": 1, "step": 5, "val_loss": 0.9, "val_accuracy": 0.5},
        {"kind": "epoch", "epoch": 2, "step": 10, "val_loss": 0.6, "val_accuracy": 0.8},
        {"kind": "epoch", "epoch": 3, "step": 15, "val_loss": 0.5, "val_accuracy": 0.7},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text('{"status": "finished"}')
    for monitor, epoch, shown in (("", 3, "val_loss 0.5 (epoch 3)"),
                                  ("val_accuracy", 2, "val_accuracy 80.00% (epoch 2)")):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"checkpoint": {"monitor": monitor}}))
        assert best_epoch(rows, monitor) is not None and best_epoch(rows, monitor)[2] == epoch  # type: ignore[index]
        summary = summarise(tmp_path)
        assert summary is not None and summary.best == shown
        page = write_report(tmp_path, evaluation=None, class_names=None).read_text()
        assert f"<td>best epoch</td><td>{epoch}: " in page


def test_the_per_step_loss_plot_has_every_step_whatever_log_every(tmp_path: Path) -> None:
    """With log_every beyond an epoch the per-step plot had one point per epoch (the logged
    steps): it now draws every step's loss, each the value its step row would have."""
    import json

    from glassloop.tracking.report import STEP_POINTS, _buckets, step_losses

    settings = ["data.name=synthetic", "model.hidden=[8]", "train.epochs=3",
                "train.progress=none", "train.log_every=1000"]  # fmt: skip
    run = build(load_config(None, settings), run_dir=tmp_path / "run")
    run.trainer.fit(run.train_loader, run.val_loader, epochs=3)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps_rows = [row for row in logged if row["kind"] == "step"]
    last = run.trainer.state.step
    assert len(steps_rows) == 3 and last > 3 * 5  # one logged step per epoch, many steps
    steps, losses = step_losses(tmp_path / "run")
    assert steps == list(range(1, last + 1))
    assert all(losses[row["step"] - 1] == row["loss"] for row in steps_rows)
    # the same through a second run that logs every step: equal values at every step
    again = build(load_config(None, [*settings[:-1], "train.log_every=1"]), run_dir=tmp_path / "b")
    again.trainer.fit(again.train_loader, again.val_loader, epochs=3)
    rows = map(json.loads, (tmp_path / "b" / "metrics.jsonl").open())
    every = {row["step"]: row["loss"] for row in rows if row["kind"] == "step"}
    assert [every[s] for s in steps] == losses
    with Image.open(tmp_path / "run" / "report" / "step_loss.png") as image:
        assert image.format == "PNG"
    # a million steps: STEP_POINTS buckets, each the mean, lowest and highest of its steps
    x, mean, low, high = _buckets(list(range(10**6)), [float(i % 7) for i in range(10**6)],
                                  STEP_POINTS)  # fmt: skip
    assert len(x) == STEP_POINTS and low[0] == 0.0 and high[0] == 6.0
    assert x[0] == 49.5 and abs(mean[0] - sum(i % 7 for i in range(100)) / 100) < 1e-12


def test_hand_edited_or_older_rows_never_break_the_per_step_plot(tmp_path: Path) -> None:
    """(review of issue 37) A step row whose step is NaN or 1e400 and losses rows that are not
    lists of numbers are left out; a run from before "losses" rows plots its step rows."""
    import json

    from glassloop.tracking.report import step_losses

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"kind": "step", "epoch": 1, "step": 1, "loss": 2.0},
        {"kind": "step", "epoch": 1, "step": float("nan"), "loss": 1.0},
        {"kind": "step", "epoch": 1, "step": True, "loss": 1.0},
        {"kind": "losses", "epoch": 1, "step": 3, "first_step": "2", "loss": [1.0]},
        {"kind": "losses", "epoch": 1, "step": 3, "first_step": 2, "loss": "1.0"},
        {"kind": "losses", "epoch": 1, "step": 4, "first_step": 3, "loss": [1.5, None, "x"]},
        {"kind": "epoch", "epoch": 1, "step": 5, "train_loss": 1.2},
    ]
    text = "\n".join(json.dumps(row) for row in rows).replace("NaN", "1e400", 1)
    (run / "metrics.jsonl").write_text(text + '\n{"kind": "step", "step": NaN, "loss": 3}\n')
    assert step_losses(run) == ([1, 3], [2.0, 1.5])
    write_report(run)
    assert (run / "report" / "step_loss.png").is_file()


def test_an_older_checkpoints_merged_losses_give_no_row_rather_than_a_wrong_one() -> None:
    """(review of issue 37) A checkpoint of an older glassloop resumed at another number of
    processes mid-epoch holds every saved process's losses without their steps: the epoch's
    per-step losses are then left out (one process here; several agree in the collective)."""
    import torch

    from glassloop.distributed.world import SINGLE
    from glassloop.state import EpochRecord

    saved = {  # two processes, 3 steps each, as an older glassloop wrote them
        "epoch_losses": None, "epoch_sizes": [], "epoch_steps": 3, "epoch_rng": None,
        "history": [], "epoch_per_rank": [
            {"epoch_losses": torch.tensor([1.0, 2.0, 3.0]), "epoch_sizes": [4, 4, 4],
             "epoch_weights": [8.0, 8.0, 8.0], "epoch_steps": 3},
            {"epoch_losses": torch.tensor([3.0, 4.0, 5.0]), "epoch_sizes": [4, 4, 4],
             "epoch_weights": [8.0, 8.0, 8.0], "epoch_steps": 3},
        ],
    }  # fmt: skip
    record = EpochRecord()
    record.load_state_dict(saved, torch.device("cpu"), SINGLE)
    assert record.step_losses(SINGLE) == [2.0, 3.0, 4.0]  # (this glassloop's: positions)
    record.add_step(torch.tensor(6.0), 8, 8, 1)
    assert record.step_losses(SINGLE) == [2.0, 3.0, 4.0, 6.0]
    record.positions = None  # as a checkpoint of the older glassloop loads
    assert record.step_losses(SINGLE) == []
