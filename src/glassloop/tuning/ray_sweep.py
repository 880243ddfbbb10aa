"""``glassloop tune --backend ray``: the space searched by Ray Tune on the cluster
``RAY_ADDRESS`` names (else a local one), drawn by Optuna's sampler (``OptunaSearch``), pruned
by Ray's scheduler on the epoch. Each trial is a glassloop run in a Ray worker
(:func:`run_trial`, ``SWEEP_DIR/trial-NNNN``), its epoch rows reported with their checkpoints,
which Ray keeps in ``SWEEP_DIR/ray/``: a trial whose worker died resumes from one, exactly;
the same command restores a sweep whose driver died (``Tuner.restore``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.tracking.runs import read_json_object
from glassloop.tuning.report import TrialRecord, mark_pruned
from glassloop.tuning.space import Space, require

EXPERIMENT = "ray"  # Ray's folder in SWEEP_DIR: its experiment state and trial checkpoints
MAX_FAILURES = 3  # a trial's worker may die this often; it resumes from its checkpoint each time


def run_ray_sweep(
    space: Space,
    config: str | Path | None,
    overrides: Sequence[str],
    folder: Path,
    trials: int,
    workers: int,
    say: Callable[[str], None],
) -> tuple[Any, list[TrialRecord]]:
    """Ray Tune's run of ``trials`` trials, ``workers`` at once: its results, and its trials
    read back as the sweep's."""
    tune = require("ray.tune", "ray")
    import ray
    from ray.tune.search.optuna import OptunaSearch

    # A row without the metric (a lone checkpoint) is no error; Ray's snapshot warning no news.
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started = not ray.is_initialized()
    if started:  # (RAY_ADDRESS: that cluster; else a local one, stopped at the end)
        ray.init(configure_logging=False)
    storage = folder.resolve()
    trainable = tune.with_resources(
        tune.with_parameters(
            run_trial,
            config_file=None if config is None else str(Path(config).resolve()),
            overrides=list(overrides),
            folder=str(storage),
            choices=[p.key for p in space.params if p.choices],
        ),
        {"cpu": 1},
    )
    try:
        if tune.Tuner.can_restore(str(storage / EXPERIMENT)):
            say(f"tune: continuing the Ray sweep in {storage / EXPERIMENT}")
            tuner = tune.Tuner.restore(
                str(storage / EXPERIMENT), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            mode = "min" if space.direction == "minimize" else "max"
            searcher = OptunaSearch(
                space=space.suggest_all, metric=space.metric, mode=mode, seed=space.seed
            )
            tuner = tune.Tuner(
                trainable,
                tune_config=tune.TuneConfig(
                    search_alg=searcher,
                    scheduler=space.pruner,
                    num_samples=trials,
                    max_concurrent_trials=workers,
                    trial_name_creator=trial_name,
                    trial_dirname_creator=trial_name,
                ),
                run_config=tune.RunConfig(
                    name=EXPERIMENT,
                    storage_path=str(storage),
                    failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                    verbose=1,
                ),
            )
        results = tuner.fit()
    finally:
        if started:
            ray.shutdown()
    return results, read_results(results, space, folder, say)


def trial_name(trial: Any) -> str:
    """``trial-0000`` for Ray's first trial (its experiment tag counts from 1)."""
    return f"trial-{int(str(trial.experiment_tag).split('_')[0]) - 1:04d}"


def run_trial(
    params: Mapping[str, Any],
    config_file: str | None,
    overrides: list[str],
    folder: str,
    choices: list[str],
) -> None:
    """One trial in a Ray worker: what ``glassloop train CONFIG --set KEY=VALUE ... --run-dir
    SWEEP_DIR/trial-NNNN`` trains, its rows and checkpoints reported to Ray; after its worker
    died, resumed from the checkpoint Ray persisted."""
    import ray.tune

    from glassloop.config.assemble import build
    from glassloop.config.schema import load_config
    from glassloop.distributed.ray_train import RayReport

    run_dir = Path(folder) / ray.tune.get_context().get_trial_name()
    values = [  # (a choice was drawn as its JSON text: a list is no optuna choice)
        f"{key}={value if key in choices else json.dumps(value)}" for key, value in params.items()
    ]
    cfg = load_config(config_file, [*overrides, *values])
    checkpoint = ray.tune.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else contextlib.nullcontext() as resume:
        run = build(cfg, run_dir=run_dir, resume=resume)
        run.trainer.callbacks.append(RayReport(tune=True))
        run.trainer.fit(run.train_loader, run.validation, epochs=cfg.train.epochs, resume=resume)


def read_results(
    results: Any, space: Space, folder: Path, say: Callable[[str], None]
) -> list[TrialRecord]:
    """Each trial of Ray's results: ``fail`` (its error), ``complete`` (its run finished) or
    ``pruned`` (the scheduler stopped it: its run.json says so from now on); a line each."""
    choices = {p.key for p in space.params if p.choices}
    records = []
    for result in sorted(results, key=lambda r: Path(r.path).name):
        run_dir = folder / Path(result.path).name
        number = int(run_dir.name.removeprefix("trial-"))
        params = {k: json.loads(v) if k in choices else v for k, v in result.config.items()}
        value = result.metrics.get(space.metric)
        shown = "-" if value is None else f"{value:.6g}"
        status = read_json_object(run_dir / layout.STATUS).get("status")
        if status == "finished" and value is None:  # (a name the runs never write)
            names = ", ".join(k for k in result.metrics if k.startswith(("val_", "train_")))
            raise GlassloopError(f"tune: the trials' rows have no {space.metric!r} ({names})")
        if result.error is not None or (status == "finished" and not math.isfinite(value)):
            records.append(TrialRecord(number, "fail", params))
            why = str(result.error).splitlines()[0] if result.error else f"{space.metric} {shown}"
            say(f"trial {number}: failed ({why})")
        elif status == "finished":
            records.append(TrialRecord(number, "complete", params, float(value)))
            say(f"trial {number}: {space.metric} {shown}")
        else:  # (stopped by the scheduler at a rung: its newest checkpoint is its epoch's)
            if status is not None:
                mark_pruned(run_dir)
            records.append(TrialRecord(number, "pruned", params))
            say(f"trial {number}: pruned at epoch {result.metrics.get('epoch')} ({shown})")
    return records
