"""Ray Train: glassloop inside ``ray.train.torch.TorchTrainer``.

Ray starts the workers and their process group (gloo on CPU, NCCL on GPUs) and sets torchrun's
variables in each (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): the Trainer
joins that group as it joins torchrun's (:func:`glassloop.distributed.world.init_from_env`
finds it initialised and leaves it as it is; it is Ray's to destroy). What a Ray user expects
beyond that is here:

* :class:`RayReport`, a callback: each epoch's row and each mid-epoch validation's row go to
  ``ray.train.report`` (Ray's ``Result.metrics`` and ``metrics_dataframe``), each with the
  checkpoint glassloop saved after it, which Ray copies into its ``storage_path``. The run
  directory keeps its own checkpoints as without Ray (``keep_last``); Ray's copies are Ray's
  (``CheckpointConfig(num_to_keep=...)``).
* :func:`resume_from_ray`: after a worker fails, Ray starts every worker again
  (``FailureConfig(max_failures=...)``) and ``ray.train.get_checkpoint()`` is the newest
  checkpoint it persisted; ``fit`` resumes from it as from any checkpoint, exactly (the
  weights, the optimizer, every RNG, the data position, the metric files cut back to it).
* :func:`glassloop.tools.ray_config.train_loop_per_worker`: ``glassloop train CONFIG --run-dir
  DIR`` in each worker, for a config file (a tool on the loop, above this part).

Ray is an optional extra (``pip install glassloop[ray]``), imported only here.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from glassloop.best import is_number
from glassloop.callbacks import AnyTrainer, Callback


class RayReport(Callback):
    """Report each row glassloop writes to metrics.jsonl but the step rows (epoch rows, and
    ``"kind": "val"`` rows of ``validate_every_n_steps``) through ``ray.train.report``, with
    the checkpoint saved right after it (rank 0 hands Ray the folder; every process reports,
    as Ray requires). A row no checkpoint follows is reported at the next step (or at the end
    of ``fit``); a checkpoint no row precedes (``every_n_steps``) with ``kind``, ``epoch`` and
    ``step``; a row after a checkpoint of its step is reported with it again (Ray's
    ``Result.metrics`` are its newest checkpoint's: the last epoch's row). A background save is
    waited for before Ray copies it. Without a run directory only the rows are reported, and
    Ray's ``Result`` (which keeps the rows reported with a checkpoint) has none."""

    def __init__(self, tune: bool = False) -> None:
        self.tune = tune  # a Ray Tune trial's: ray.tune.report, not ray.train.report
        self.pending: dict[str, Any] | None = None  # a row not reported yet
        self.validation: dict[str, Any] | None = None  # the last mid-epoch row taken
        self.reported_step = -1  # the step of the last checkpoint handed to Ray

    def take_validation(self, trainer: AnyTrainer) -> None:
        """The Validator's newest mid-epoch row (``validate_every_n_steps``), once; a row
        still pending before it is reported first."""
        row = trainer.validator.last_row
        if row is not None and row is not self.validation:
            if self.pending is not None:
                self.report(trainer, None)
            self.validation = self.pending = row

    def on_epoch_end(self, trainer: AnyTrainer, row: dict[str, Any]) -> None:
        self.take_validation(trainer)  # (one at the epoch's last step, with no save after it)
        if self.pending is not None:
            self.report(trainer, None)
        self.pending = row  # (read when reported: callbacks after this one may add keys)

    def on_step_end(self, trainer: AnyTrainer, step: int, loss: torch.Tensor) -> None:
        self.take_validation(trainer)  # (the last step's, which no checkpoint followed)
        if self.pending is not None:  # no checkpoint followed it
            self.report(trainer, None)

    def on_checkpoint(self, trainer: AnyTrainer, path: Path) -> None:
        self.take_validation(trainer)
        if self.pending is None and trainer.state.step == self.reported_step:
            return  # (the final save of a step Ray has, with its row)
        trainer.checkpointer.wait()  # a background save: complete before Ray copies it
        self.report(trainer, path)

    def on_fit_end(self, trainer: AnyTrainer) -> None:
        self.take_validation(trainer)
        if self.pending is not None and trainer.run_dir is None:  # (no final save follows)
            self.report(trainer, None)

    def report(self, trainer: AnyTrainer, path: Path | None) -> None:
        """``ray.train.report`` of the pending row (or, for a checkpoint alone, where the run
        stands) with the checkpoint at ``path`` (rank 0's)."""
        # Ray Tune's trial or Ray Train's worker: each has its own report and Checkpoint.
        api = importlib.import_module("ray.tune" if self.tune else "ray.train")
        state = trainer.state
        row = self.pending or {"kind": "checkpoint", "epoch": state.epoch, "step": state.step}
        metrics = {k: v for k, v in row.items() if is_number(v) or isinstance(v, str)}
        checkpoint = None
        if path is not None and trainer.world.is_main:
            checkpoint = api.Checkpoint.from_directory(str(path))
        api.report(metrics, checkpoint=checkpoint)
        self.pending = None
        if path is not None:
            self.reported_step = state.step


@contextlib.contextmanager
def resume_from_ray(default: str | None = "auto") -> Iterator[str | None]:
    """What ``fit`` resumes from in a Ray Train worker: the newest checkpoint Ray persisted
    (``ray.train.get_checkpoint()``, there after a worker failure), as a local folder for the
    time of the block (Ray downloads one kept on object storage and removes it after); when
    Ray has none, ``default``: ``"auto"``, the run directory's newest checkpoint, or a fresh
    run when it has none (what ``--resume`` does: a restart before Ray had a checkpoint goes
    on from the run directory's); ``None`` without a run directory. In the training
    function::

        with resume_from_ray() as resume:
            trainer.fit(train_loader, val_loader, epochs=5, resume=resume)
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield default
        return
    with checkpoint.as_directory() as folder:
        yield str(folder)
