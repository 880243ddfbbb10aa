"""A config file trained in Ray Train's workers: ``glassloop train CONFIG --run-dir DIR`` as a
``TorchTrainer``'s ``train_loop_per_worker``, reporting to Ray and resuming from Ray's
checkpoints (:mod:`glassloop.distributed.ray_train`). Ray is imported only when it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from glassloop.errors import ConfigError

ENTRY_KEYS = ("config", "run_dir", "overrides", "resume")


def train_loop_per_worker(config: Mapping[str, Any]) -> None:
    """``glassloop train CONFIG --run-dir DIR`` in each worker of a ``TorchTrainer``:
    ``config`` (its ``train_loop_config``) holds ``"config"`` (the TOML's path, absolute, as
    each worker reads it; left out: the defaults), ``"run_dir"`` (a path every worker sees,
    or an ``s3://`` URL), optionally ``"overrides"`` (``--set``'s ``key=value`` strings) and
    ``"resume"`` (what a first start resumes from: ``"auto"`` by default,
    :func:`~glassloop.distributed.ray_train.resume_from_ray`). Rows and checkpoints go to
    Ray (:class:`~glassloop.distributed.ray_train.RayReport`); after a worker failure the
    run resumes from Ray's newest checkpoint."""
    from glassloop.config.assemble import build
    from glassloop.config.schema import load_config
    from glassloop.distributed.ray_train import RayReport, resume_from_ray

    unknown = sorted(set(config) - set(ENTRY_KEYS))
    if unknown or not config.get("run_dir"):
        raise ConfigError(
            "ray: train_loop_config takes 'config', 'run_dir' (required), 'overrides' and "
            f"'resume'; got {sorted(config)}"
        )
    cfg = load_config(config.get("config"), list(config.get("overrides", ())))
    with resume_from_ray(config.get("resume", "auto")) as resume:
        run = build(cfg, run_dir=str(config["run_dir"]), resume=resume)
        run.trainer.callbacks.append(RayReport())
        run.trainer.fit(run.train_loader, run.validation, epochs=cfg.train.epochs, resume=resume)
