"""Ray Train (issue 49): glassloop in ``ray.train.torch.TorchTrainer`` on a local Ray cluster
(2 CPUs, two workers, gloo), started and stopped by this module.

* The config entry (:func:`glassloop.tools.ray_config.train_loop_per_worker`) trains
  what ``glassloop train --nproc 2`` trains: the same weights and every epoch row.
* A worker SIGKILLed mid-epoch is restarted by Ray (``FailureConfig``), resumes from the
  checkpoint Ray persisted (``ray.train.get_checkpoint()``), and the run ends bitwise the
  uninterrupted Ray run's: the weights, every row of metrics.jsonl, and what Ray reported.
* docs/distributed.md's Ray Train example runs as written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_glassloop

from glassloop.tools.ray_config import train_loop_per_worker

pytestmark = pytest.mark.xdist_group("test_ray_train")

# 256 training samples, 8 a process: 16 steps an epoch; a checkpoint every 6 steps (Ray is
# handed each), a validation every 9 (its row reported), 3 epochs.
OVERRIDES = [
    "data.name=synthetic", "data.num_samples=320", "data.batch_size=8", "data.num_features=8",
    "model.hidden=[16]", "model.dropout=0.1", "train.epochs=3", "checkpoint.every_n_steps=6",
    "train.validate_every_n_steps=9", "train.progress=none", "train.dist_timeout_s=20",
]  # fmt: skip
KILL_AT = 40  # rank 1 dies after step 40 (in epoch 3), after step 36's checkpoint
TIMING = ("seconds", "samples_per_s", "checkpoint_s")


@pytest.fixture(scope="module", autouse=True)
def by_value(ray_cluster: str) -> None:
    """Ray pickles the training functions below by reference unless told: its workers cannot
    import this test module."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fit(function: Any, config: dict[str, Any], storage: Path, failures: int = 0) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        function,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(storage), name="run", failure_config=FailureConfig(failures)
        ),
    )
    return trainer.fit()


def killed_once(config: dict[str, Any]) -> None:
    """The config entry, with rank 1 SIGKILLed after step ``KILL_AT`` in its first attempt
    (the marker file tells a restart from it)."""
    import glassloop.distributed.ray_train as ray_train

    marker = Path(config["marker"])
    reports = ray_train.RayReport.on_step_end

    def on_step_end(self: Any, trainer: Any, step: int, loss: Any) -> None:
        if step == KILL_AT and trainer.world.rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        reports(self, trainer, step, loss)

    ray_train.RayReport.on_step_end = on_step_end  # type: ignore[method-assign]
    train_loop_per_worker({k: v for k, v in config.items() if k != "marker"})


def rows(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows but the step rows, without their clocks."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in found if r["kind"] != "step"]


def reported(result: Any) -> list[dict[str, Any]]:
    """The rows Ray kept (those reported with a checkpoint), without their clocks."""
    frame = result.metrics_dataframe.to_dict("records")
    return [{k: v for k, v in r.items() if k not in TIMING and v == v} for r in frame]


def test_a_worker_killed_mid_epoch_is_restarted_by_ray_and_the_run_ends_bitwise(
    ray_cluster: str, tmp_path: Path
) -> None:
    config = {"overrides": OVERRIDES}
    straight = fit(train_loop_per_worker, {**config, "run_dir": str(tmp_path / "a")}, tmp_path)
    assert straight.error is None
    a = tmp_path / "a"
    epochs = [row for row in rows(a) if row["kind"] == "epoch"]
    assert [row["epoch"] for row in epochs] == [1, 2, 3]
    assert any(row["kind"] == "val" for row in rows(a))  # (mid-epoch validations)
    # Ray's result: the last epoch's row, and glassloop's final checkpoint
    last = {k: v for k, v in straight.metrics.items() if k not in TIMING}
    assert last == epochs[-1]
    ray_checkpoint = Path(straight.checkpoint.path)
    assert (ray_checkpoint / "model.safetensors").read_bytes() == (
        a / "checkpoints" / "step-00000048" / "model.safetensors"
    ).read_bytes()
    # every row Ray kept is one glassloop wrote (a checkpoint alone: its step)
    written = {(row["kind"], row["step"]): row for row in rows(a)}
    for row in reported(straight):
        if row["kind"] != "checkpoint":
            assert row == written[(row["kind"], row["step"])], row
    kept = [(row["kind"], row["step"]) for row in reported(straight)]
    assert kept == [("checkpoint", 6), ("checkpoint", 12), ("epoch", 16), ("val", 18),
                    ("checkpoint", 24), ("checkpoint", 30), ("epoch", 32), ("val", 36),
                    ("checkpoint", 42), ("checkpoint", 48), ("epoch", 48)]  # fmt: skip

    # rank 1 killed after step 40: Ray restarts both workers, which resume from step 36
    b = tmp_path / "b"
    marker = tmp_path / "killed"
    killed = fit(
        killed_once,
        {**config, "run_dir": str(b), "marker": str(marker)},
        tmp_path / "ray-b",
        failures=1,
    )
    assert marker.exists() and killed.error is None
    # from a checkpoint in Ray's storage: step 36's, or an earlier one when the controller had
    # not taken 36's report from the worker's queue before it died
    resumed = re.findall(r"resumed from '([^']+)' at step (\d+)", ray_logs())
    [(where, step)] = [found for found in resumed if str(tmp_path) in found[0]]
    assert where.startswith(str(tmp_path / "ray-b" / "run")) and int(step) <= 36, resumed
    assert (b / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()
    assert rows(b) == rows(a)
    assert {k: v for k, v in killed.metrics.items() if k not in TIMING} == last

    # the same job under torchrun: the same weights and rows
    c = tmp_path / "c"
    sets = [word for override in OVERRIDES for word in ("--set", override)]
    done = run_glassloop("train", *sets, "--nproc", "2", "--run-dir", str(c), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (c / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()
    assert rows(c) == rows(a)


def ray_logs() -> str:
    """What the workers of this Ray session printed."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return "".join(path.read_text(errors="replace") for path in session.glob("logs/worker-*.out"))


def test_the_docs_example_runs_as_written(
    ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    page = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text(encoding="utf-8")
    [code] = [c for c in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M) if "Ray" in c]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, "docs/distributed.md", "exec"), scope)  # (our own page)
    said = capsys.readouterr().out
    epoch = [row for row in rows(tmp_path / "runs" / "ray") if row["kind"] == "epoch"][-1]
    assert f"epoch 3: val_loss {epoch['val_loss']:.4f}" in said, said
    files = sorted(os.listdir(tmp_path / "runs" / "ray" / "checkpoints" / "step-00000036"))
    assert f"Ray's checkpoint: {files}" in said, said


def test_the_config_entry_names_what_it_takes_in_one_line() -> None:
    from glassloop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"takes 'config', 'run_dir' \(required\).*\['config'\]"):
        train_loop_per_worker({"config": "my.toml"})
    with pytest.raises(ConfigError, match=r"got \['run_dir', 'rundir'\]"):
        train_loop_per_worker({"run_dir": "runs/a", "rundir": "runs/a"})
