"""A run directory's own files: ``config.json``, ``run.json``, the metric rows
(``metrics.csv``, ``metrics.jsonl``, TensorBoard) and the final ``model.safetensors``.

:class:`RunLog` does nothing without a run directory or in a process other than rank 0, so the
loop calls it without asking. Every write failure is a
:class:`~glassloop.checkpoint.CheckpointWriteError` (exit code 3) naming the path and the OS's
reason; checkpoints themselves are :mod:`glassloop.checkpointer`'s job.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import glassloop.fsdp as fsdp
from glassloop.atomic import ForeignPathError, own_dir
from glassloop.checkpoint import (
    BEST,
    CHECKPOINTS,
    LATEST,
    STEP_DIR,
    CheckpointError,
    CheckpointWriteError,
    clean_temporaries,
    save_weights,
    unwrap_model,
    weights_metadata,
    write_failure,
    write_json,
)
from glassloop.distributed import SINGLE, World
from glassloop.errors import GlassloopError
from glassloop.run_lock import RunLock
from glassloop.runs import read_json_object
from glassloop.serialization import stable_repr
from glassloop.sinks import CSVSink, JSONLSink, TensorBoardSink, truncate_rows
from glassloop.tracking import Tracker, TrackingConfig, make_tracker

if TYPE_CHECKING:
    from glassloop.loop import Trainer

CSV_FIELDS = [
    "kind", "epoch", "step", "samples", "train_loss", "loss", "lr", "grad_norm", "samples_per_s",
    "seconds",
]  # fmt: skip
Sink = CSVSink | JSONLSink | TensorBoardSink
REPORT_EVERY_S = 60.0  # how often a running run's report/ is refreshed (plots take ~0.5 s)


class RunLog:
    """Writes the run directory's files (rank 0 only; nothing without a run directory)."""

    def __init__(
        self,
        run_dir: Path | None,
        *,
        world: World = SINGLE,
        tensorboard: bool = False,
        tracking: TrackingConfig | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.active = run_dir is not None and world.is_main
        self.tensorboard = tensorboard
        self.tracking = tracking
        self._tracker: Tracker | None = None
        self._sinks: list[Sink] = []
        self._last_step = (time.perf_counter(), 0)  # when the last step row was, its samples
        self._last_report = time.monotonic()  # the first report after REPORT_EVERY_S
        self._started: str | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Create the run directory, hold its lock (one training process per directory) and
        remove what an interrupted glassloop left in it, for the whole ``fit``."""
        if not self.active:
            yield
            return
        assert self.run_dir is not None
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise GlassloopError(f"run: '{self.run_dir}' is a file, not a run directory")
        refuse_links(self.run_dir)  # before anything, the lock included, is written
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(self.run_dir)
            lock.acquire()
        except OSError as err:
            raise self.failure(err) from err
        try:
            clean_temporaries(self.run_dir)
            yield
        finally:
            lock.release()

    def open(
        self, *, step: int, epoch: int = 0, has_val: bool, config: dict[str, Any],
        environment: dict[str, Any],
    ) -> None:  # fmt: skip
        """Write config.json and run.json ("running") and open the metric files; a resumed
        run (``step`` > 0) keeps its rows up to ``step`` (epoch rows up to ``epoch``, the
        epochs it finished) and appends."""
        if not self.active:
            return
        assert self.run_dir is not None
        fields = list(CSV_FIELDS)
        if has_val:
            fields[5:5] = ["val_loss", "val_accuracy"]
        fresh = step == 0  # a new run replaces the metrics of one that never saved
        # (A backend that is not installed is refused before anything is written.)
        self._tracker = make_tracker(self.tracking)
        # When the run began (a resumed run keeps its first start), for `glassloop runs`.
        earlier = None if fresh else read_json_object(self.run_dir / "run.json").get("started")
        self._started = earlier if isinstance(earlier, str) else _now()
        try:
            if not fresh:  # rows a killed process wrote after its last checkpoint go
                truncate_rows(self.run_dir, step, epoch)
            write_json(self.run_dir / "config.json", config)
            write_json(
                self.run_dir / "run.json",
                {"status": "running", "started": self._started, **environment},
            )
            self._sinks = [
                CSVSink(self.run_dir / "metrics.csv", fields, fresh=fresh),
                JSONLSink(self.run_dir / "metrics.jsonl", fresh=fresh),
            ]
        except OSError as err:
            raise self.failure(err) from err
        if self.tensorboard:
            self._sinks.append(TensorBoardSink(own_dir(self.run_dir / "tensorboard")))
        if self._tracker is not None:
            self._tracker.start(self.run_dir, config, resume=not fresh)

    def write(self, row: dict[str, Any]) -> None:
        """One metrics row to every sink; a full disk is a write failure (exit 3)."""
        if self._tracker is not None:
            self._tracker.log(row)  # never raises: a failing backend turns itself off
        for sink in self._sinks:
            try:
                sink.write(row)
            except OSError as err:
                raise self.failure(err, getattr(sink, "path", None)) from err

    def failure(self, err: OSError | CheckpointError, path: Path | None = None) -> Exception:
        """The one line of a failed write of a run file: which file, the OS's reason; the
        checkpoints written so far are intact (that row or file is what is lost)."""
        assert self.run_dir is not None  # files are written only with a run directory
        named = getattr(err, "filename", None)
        where = Path(named) if isinstance(named, str) else (path or self.run_dir)
        if ours := TEMPORARY.fullmatch(where.name):  # the file it was about to replace
            where = where.with_name(ours.group(1))
        return write_failure(where, err, safe="the checkpoints written so far are intact")

    def write_step(
        self,
        *,
        epoch: int,
        step: int,
        samples: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
    ) -> None:
        """A ``"kind": "step"`` row, with the samples per second since the previous one."""
        now = time.perf_counter()
        last_time, last_samples = self._last_step
        self._last_step = (now, samples)
        rate = (samples - last_samples) / (now - last_time) if last_samples else None
        self.write({
            "kind": "step", "epoch": epoch, "step": step, "samples": samples, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "samples_per_s": rate,
        })  # fmt: skip

    def report_due(self) -> bool:
        return time.monotonic() - self._last_report >= REPORT_EVERY_S

    def write_report(
        self,
        *,
        evaluation: dict[str, Any] | None,
        class_names: list[str] | None,
        predicted_vs_true: Any = None,
        final: bool = False,
    ) -> Path | None:
        """``RUN_DIR/report/`` (:func:`glassloop.report.write_report`), at most every
        ``REPORT_EVERY_S`` seconds during the run (so a long run's report can be watched, at
        a cost of well under 1% of its time) and always at the end; its path, or ``None``
        when nothing was written."""
        if not self.active or (not final and not self.report_due()):
            return None
        self._last_report = time.monotonic()
        from glassloop.report import write_report

        assert self.run_dir is not None
        try:
            return write_report(
                self.run_dir, evaluation=evaluation, class_names=class_names,
                predicted_vs_true=predicted_vs_true,
            )  # fmt: skip
        except OSError as err:
            raise self.failure(err) from err

    def check_exists(self) -> None:
        """Refuse to write into a run directory that disappeared during the run (never
        recreate it half-empty, without its config and metrics)."""
        if self.active and self.run_dir is not None and not self.run_dir.is_dir():
            raise CheckpointWriteError(
                f"checkpoint: the run directory '{self.run_dir}' disappeared during the run "
                "(deleted or unmounted?); not recreating it without its config and metrics"
            )

    def close(
        self,
        status: str,
        *,
        model: nn.Module | dict[str, torch.Tensor],
        model_spec: dict[str, Any] | None,
        info: dict[str, Any],
        report: Callable[[], Path | None] | None = None,
    ) -> Path | None:
        """Close the metric files; write the final weights (``status == "finished"``) and
        run.json, then (finished) the final ``report()``, which shows how the run ended;
        return its path. While another error is already on its way out (``status`` "failed"
        or "interrupted"), a failure here is only returned as a warning line, so that error
        is the one the user sees."""
        for sink in self._sinks:
            try:
                sink.close()
            except OSError as err:  # the rows a failed write left in its buffer fail again
                if status == "finished":
                    raise self.failure(err, getattr(sink, "path", None)) from err
        self._sinks = []
        if not self.active:
            return None
        written = None
        try:
            self.check_exists()
            if status == "finished":
                self.write_weights(model, model_spec)
            self.write_status(status, info)
            if status == "finished" and report is not None:
                written = report()
            if self._tracker is not None:
                assert self.run_dir is not None  # a tracker exists only with a run directory
                files = sorted((self.run_dir / "report").glob("*"))
                self._tracker.finish(status, [*files, self.run_dir / "model.safetensors"])
                self._tracker = None
        except (OSError, CheckpointError) as err:
            assert self.run_dir is not None
            failure = self.failure(err)
            if status == "finished":
                raise failure from err
            print(f"warning: {failure}")
        return written

    def write_weights(
        self, model: nn.Module | dict[str, torch.Tensor], model_spec: dict[str, Any] | None
    ) -> None:
        assert self.run_dir is not None
        save_weights(model, self.run_dir / "model.safetensors", weights_metadata(model_spec))

    def write_status(self, status: str, info: dict[str, Any]) -> None:
        assert self.run_dir is not None
        times = {"started": self._started, "ended": _now()} if self._started else {}
        write_json(self.run_dir / "run.json", {"status": status, **times, **info})

    def complete(
        self,
        *,
        model: nn.Module | dict[str, torch.Tensor],
        model_spec: dict[str, Any] | None,
        info: dict[str, Any],
    ) -> list[str]:
        """For a finished run resumed: write the final files a kill left out; their names."""
        if not self.active:
            return []
        assert self.run_dir is not None
        missing = []
        try:
            if not (self.run_dir / "model.safetensors").is_file():
                self.write_weights(model, model_spec)
                missing.append("model.safetensors")
            if _status(self.run_dir) != "finished":
                self.write_status("finished", info)
                missing.append("run.json")
        except OSError as err:
            raise self.failure(err) from err
        return missing


TEMPORARY = re.compile(r"\.(.+)\.tmp(?:-\d+)?")  # atomic_path's name for a file being written
# What glassloop writes in a run directory (checkpoints/ and report/ are checked inside too).
OWN_NAMES = (
    ".lock", "config.json", "run.json", "metrics.csv", "metrics.jsonl", "model.safetensors",
    CHECKPOINTS, BEST, "report", "tensorboard", "tracking.json", "wandb",
)  # fmt: skip


def refuse_links(run_dir: Path) -> None:
    """Stop before anything is written when a symbolic link sits where glassloop keeps its
    own files (a checkpoint or ``best/`` linked to another disk, a prepared run directory):
    glassloop never writes, replaces or deletes through one, so the run could not go on."""
    found = [run_dir / name for name in OWN_NAMES if (run_dir / name).is_symlink()]
    for folder, owned in ((run_dir / CHECKPOINTS, STEP_DIR.pattern), (run_dir / "report", "")):
        if folder.is_dir() and not folder.is_symlink():
            found += [
                p for p in sorted(folder.iterdir())
                if p.is_symlink() and (not owned or STEP_DIR.match(p.name) or p.name == LATEST)
            ]  # fmt: skip
    if found:
        names = ", ".join(f"'{p}'" for p in found)
        raise ForeignPathError(
            f"run: {names} {'is a symbolic link' if len(found) == 1 else 'are symbolic links'}"
            " where glassloop keeps its own files; glassloop never writes, replaces or deletes"
            " through a link and left everything untouched: remove the link(s) (their targets"
            " stay as they are), or choose another --run-dir"
        )


def _status(run_dir: Path) -> str | None:
    status = read_json_object(run_dir / "run.json").get("status")
    return status if isinstance(status, str) else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def python_config(trainer: Trainer) -> dict[str, Any]:
    """The configuration of a run built in Python (no config file): what a resume compares."""
    return {
        "model": fsdp.class_name(unwrap_model(trainer.model)),
        "num_parameters": sum(p.numel() for p in trainer.model.parameters()),
        "optimizer": type(trainer.optimizer).__name__,
        "optimizer_defaults": {
            k: _jsonable(v) for k, v in sorted(trainer.optimizer.defaults.items())
        },
        "loss_fn": stable_repr(trainer.loss_fn),
        "task": trainer.task,
        "scheduler": type(trainer.scheduler).__name__ if trainer.scheduler is not None else None,
        "scheduler_interval": trainer.scheduler_interval,
        "precision": trainer.precision,
        "grad_accum_steps": trainer.grad_accum_steps,
        "limit_batches": trainer.limit_batches,
        "loss_weighting": trainer.loss_weighting,
        # (only when it sums: runs written before the setting existed compare unchanged)
        **({"loss_reduction": "sum"} if trainer.loss_reduction == "sum" else {}),
        "clip_grad_norm": trainer.clip_grad_norm,
        "clip_grad_value": trainer.clip_grad_value,
        "ema_decay": trainer.ema_decay,
        "compile": trainer.model is not unwrap_model(trainer.model),
        "device": str(trainer.device),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return stable_repr(value)
