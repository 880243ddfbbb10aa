"""A run directory's own files: ``config.json``, ``run.json``, the metric rows
(``metrics.csv``, ``metrics.jsonl``, TensorBoard) and the final ``model.safetensors``.

:class:`RunLog` does nothing without a run directory or in a process other than rank 0, so the loop
calls it without asking. Every write failure is a
:class:`~glassloop.run_dir.checkpoints.CheckpointWriteError` (exit code 3) naming the path and the
OS's reason; checkpoints themselves are :mod:`glassloop.checkpoint.checkpointer`'s job."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

import glassloop.distributed.fsdp as fsdp
from glassloop.distributed.world import unwrap_model
from glassloop.errors import CheckpointError, write_failure
from glassloop.options import RunInfo, TrackingConfig
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import require_run_dir
from glassloop.run_dir.run import RunDir
from glassloop.state import EpochRecord, TrainState
from glassloop.storage.atomic import own_dir
from glassloop.storage.file_names import check_key
from glassloop.storage.frozen_base import METADATA_KEY as BASE_KEY
from glassloop.storage.hugging_face import describe
from glassloop.storage.serialization import behaviour_digest, stable_repr, write_json
from glassloop.storage.weights import save_weights, weights_metadata
from glassloop.tracking.launched import since_launch
from glassloop.tracking.runs import read_json_object
from glassloop.tracking.sinks import CSVSink, Destination, JSONLSink, TensorBoardSink, truncate_rows
from glassloop.tracking.trackers import Tracker, make_tracker

CSV_FIELDS = [
    "kind",
    "epoch",
    "step",
    "samples",
    "train_loss",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "seconds",
    "checkpoint_s",
]
Sink = CSVSink | JSONLSink | TensorBoardSink
REPORT_EVERY_S = 60.0  # how often a running run's report/ is refreshed (plots take ~0.5 s)


class RunLog:
    """Writes the run directory's files (rank 0 only; nothing without a run directory) and
    sends each row the loop makes to every destination that takes its kind: the tracker, the
    metric files, TensorBoard and the console (:class:`~glassloop.tracking.sinks.Destination`;
    the console also without a run directory)."""

    def __init__(
        self,
        run: RunDir,
        console: Destination | None = None,
        *,
        tensorboard: bool = False,
        tracking: TrackingConfig | None = None,
        state: TrainState | None = None,
        info: RunInfo | None = None,
    ) -> None:
        """``run``: the run directory (:class:`glassloop.run_dir.run.RunDir`: where it is, its
        remote copy, its checkpoints' times, the frozen base the final weights leave out)."""
        self.run = run
        self.run_dir, self.remote, self.active = run.path, run.remote, run.writes
        self.console = console
        # Handed once: where the loop stands and what the run records (filled in by fit).
        self.state = state if state is not None else TrainState()
        self.info = info if info is not None else RunInfo()
        self.tensorboard = tensorboard
        self.tracking = tracking
        self._tracker: Tracker | None = None
        self._sinks: list[Sink] = []
        self._last_step = (time.perf_counter(), 0)  # when the last step row was, its samples
        self._last_report = time.monotonic()  # the first report after REPORT_EVERY_S
        self._started: str | None = None

    def start(self, *, has_val: bool) -> None:
        """Write config.json and run.json ("running") and open the metric files; a resumed
        run (``state.step`` > 0) keeps its rows up to that step (epoch rows up to the epochs
        it finished) and appends."""
        if not self.active:
            return
        assert self.run_dir is not None
        state, info = self.state, self.info
        step, epoch, config = state.step, state.epoch, info.config or {}
        fields = list(CSV_FIELDS)
        if has_val:
            fields[5:5] = ["val_loss", "val_accuracy"]
        fresh = step == 0  # a new run replaces the metrics of one that never saved
        # (A backend that is not installed is refused before anything is written.)
        self._tracker = make_tracker(self.tracking)
        # When the run began (a resumed run keeps its first start), for `glassloop runs`.
        earlier = None if fresh else read_json_object(self.run_dir / layout.STATUS).get("started")
        self._started = earlier if isinstance(earlier, str) else _now()
        try:
            if not fresh:  # rows a killed process wrote after its last checkpoint go
                truncate_rows(self.run_dir, step, epoch)
            write_json(self.run_dir / layout.CONFIG, config)
            write_json(
                self.run_dir / layout.STATUS,
                {"status": "running", "started": self._started, **info.versions},
            )
            self._sinks = [
                CSVSink(self.run_dir / layout.METRICS_CSV, fields, fresh=fresh),
                JSONLSink(self.run_dir / layout.METRICS_JSONL, fresh=fresh),
            ]
        except OSError as err:
            raise self.failure(err) from err
        if self.tensorboard:
            self._sinks.append(TensorBoardSink(own_dir(self.run_dir / layout.TENSORBOARD)))
        if self._tracker is not None:
            self._tracker.start(self.run_dir, config, resume=not fresh, step=step)

    @property
    def destinations(self) -> list[Destination]:
        """Where a row goes, in this order: the tracker, the files, the console."""
        tracker: list[Destination] = [self._tracker] if self._tracker is not None else []
        console = [self.console] if self.console is not None else []
        return [*tracker, *self._sinks, *console]

    def write(self, row: dict[str, Any]) -> None:
        """One row to each destination that takes its kind (``row["kind"]``:
        :mod:`glassloop.tracking.sinks`); a full disk is a write failure (exit 3). A key the
        files cannot hold (a callback's, an ``evaluate`` override's, a ``train_step``'s named
        loss) is one line before any of them is written."""
        for key in row:
            check_key(key, "metrics: the row key")
        kind = row["kind"]
        for destination in self.destinations:
            if kind not in destination.kinds:
                continue
            try:
                destination.write(row)  # (a tracker never raises: a failing one turns off)
            except OSError as err:
                if destination is self.console:  # the terminal's, not the run directory's
                    raise
                raise self.failure(err, getattr(destination, "path", None)) from err

    def failure(self, err: OSError | CheckpointError, path: Path | None = None) -> Exception:
        """The one line of a failed write of a run file: which file, the OS's reason; the
        checkpoints written so far are intact (that row or file is what is lost)."""
        assert self.run_dir is not None  # files are written only with a run directory
        named = getattr(err, "filename", None)
        where = Path(named) if isinstance(named, str) else (path or self.run_dir)
        if ours := TEMPORARY.fullmatch(where.name):  # the file it was about to replace
            where = where.with_name(ours.group(1))
        return write_failure(where, err, safe="the checkpoints written so far are intact")

    def write_step(self, *, loss: float, lr: float, grad_norm: float | None) -> None:
        """A ``"kind": "step"`` row of where the run stands, with the samples per second
        since the previous one."""
        state = self.state
        epoch, step, samples = state.epoch + 1, state.step, state.samples_seen
        now = time.perf_counter()
        last_time, last_samples = self._last_step
        self._last_step = (now, samples)
        rate = (samples - last_samples) / (now - last_time) if last_samples else None
        self.write(
            {
                "kind": "step",
                "epoch": epoch,
                "step": step,
                "samples": samples,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "samples_per_s": rate,
            }
        )

    def write_losses(self, row: dict[str, Any], record: EpochRecord) -> None:
        """The epoch of ``row``: every step loss of its ``record`` (``"kind": "losses"``, its
        first step and the list, NaN as null, read in one host read; with several processes
        a collective), which ``metrics.jsonl`` alone takes: the report's per-step plot, not a
        metric row for the CSV, TensorBoard, a tracker or the console (they get the step
        rows). Nothing without a run directory."""
        if self.run_dir is None:
            return
        epoch, last_step, losses = row["epoch"], row["step"], record.step_losses(self.run.world)
        if not losses:
            return
        first = last_step - len(losses) + 1
        values = [value if math.isfinite(value) else None for value in losses]
        written = {"kind": "losses", "epoch": epoch, "step": last_step, "first_step": first}
        self.write({**written, "loss": values})

    def report_due(self) -> bool:
        return time.monotonic() - self._last_report >= REPORT_EVERY_S

    def report(
        self,
        evaluation: dict[str, Any] | None,
        *,
        predicted_vs_true: Any = None,
        final: bool = False,
    ) -> Path | None:
        """``RUN_DIR/report/`` (:func:`glassloop.tracking.report.write_report`) from the metrics and
        the last validation, at most every ``REPORT_EVERY_S`` seconds during the run (so a
        long run's report can be watched, at a cost of well under 1% of its time) and always
        at the end; its path, or ``None`` when nothing was written. A regression's
        ``predicted_vs_true`` is computed at the end only (iterating a DataLoader draws from
        the global RNG, which must not depend on when a refresh fell due)."""
        if not self.active or (not final and not self.report_due()):
            return None
        class_names = (self.info.model_spec or {}).get("class_names")
        self._last_report = time.monotonic()
        from glassloop.tracking.report import write_report

        assert self.run_dir is not None
        try:
            return write_report(
                self.run_dir,
                evaluation=evaluation,
                class_names=class_names,
                predicted_vs_true=predicted_vs_true,
            )
        except OSError as err:
            raise self.failure(err) from err

    def finish(
        self,
        status: str,
        model: nn.Module,
        *,
        error: str | None = None,
        evaluation: dict[str, Any] | None = None,
        predicted_vs_true: Any = None,
    ) -> Path | None:
        """Stop the run's clocks (the report's drawing is not training); close the metric
        files; write the final weights (``status == "finished"``: those of ``model``, a
        sharded one gathered into rank 0, a collective) and run.json, then
        (finished) the final report, which shows how the run ended; return its path. While
        another error is already on its way out (``status`` "failed" or "interrupted"), a
        failure here is only returned as a warning line, so that error is the one the user
        sees."""
        self.state.end_clock(since_launch())  # (in every process: the end summary's)
        weights = final_weights(model) if status == "finished" else model
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
        status_info = self._status_info()
        if error is not None and status == "failed":
            status_info["error"] = error
        assert self.run_dir is not None  # (active: it has one)
        try:
            require_run_dir(self.run_dir)
            if status == "finished":
                self.write_weights(weights, self.info.model_spec)
            self.write_status(status, status_info)
            if status == "finished":
                written = self.report(evaluation, predicted_vs_true=predicted_vs_true, final=True)
            if self._tracker is not None:
                assert self.run_dir is not None  # a tracker exists only with a run directory
                files = sorted((self.run_dir / layout.REPORT).glob("*"))
                self._tracker.finish(status, [*files, self.run_dir / layout.WEIGHTS])
                self._tracker = None
        except (OSError, CheckpointError) as err:
            assert self.run_dir is not None
            failure = self.failure(err)
            if status == "finished":
                raise failure from err
            print(f"warning: {failure}")
        finally:  # (while an error of its own is on its way out: an upload's is a warning)
            self._upload(status if sys.exc_info()[0] is None else "failed")
        return written

    def _upload(self, status: str) -> None:
        """The run's files to the remote run, every upload done before the run ends (a
        failure while another error is on its way out: a warning)."""
        if self.remote is not None:
            self.remote.push_run_files()
            self.remote.close(quiet=status != "finished")

    def _status_info(self) -> dict[str, Any]:
        """What run.json says besides the status: where the run stands, what ran it."""
        info = {"step": self.state.step, "epoch": self.state.epoch, **self.info.versions}
        # the run's training time (resumes add theirs, never the pause) and this command's
        info["train_s"] = round(self.state.train_seconds(), 2)
        wall = self.state.wall_s if self.state.wall_s is not None else since_launch()
        info["wall_s"] = round(wall, 2)
        if (times := self.run.times.summary()) is not None:
            info["checkpoints"] = times
        if self.remote is not None:
            info.update(self.remote.state_info())
        return info

    def write_weights(
        self, model: nn.Module | dict[str, torch.Tensor], model_spec: dict[str, Any] | None
    ) -> None:
        assert self.run_dir is not None
        metadata = weights_metadata(model_spec)
        if isinstance(model, nn.Module):
            tensors, record = (
                self.run.base.split(model)
                if self.run.base
                else (unwrap_model(model).state_dict(), None)
            )
            if record is not None:  # an adapter, without its base: the base's record
                metadata[BASE_KEY] = json.dumps(record, sort_keys=True)
            # a transformers or peft model's configuration: glassloop export --format hf
            metadata.update(describe(model, set(tensors)))
            model = tensors
        save_weights(model, self.run_dir / layout.WEIGHTS, metadata)

    def write_status(self, status: str, info: dict[str, Any]) -> None:
        assert self.run_dir is not None
        times = {"started": self._started, "ended": _now()} if self._started else {}
        write_json(self.run_dir / layout.STATUS, {"status": status, **times, **info})

    def finish_again(self, model: nn.Module, epochs: int) -> str:
        """Resuming a finished run: write the final files a kill left out (finishing is
        idempotent); what to say about it. ``model`` as for :meth:`finish` (a collective when
        sharded)."""
        weights = final_weights(model)
        state = self.state
        missing = self._write_missing(weights) if self.active else []
        if missing and self.active:
            self._upload("finished")  # (a remote run's final files, too)
        why = "stopped early" if state.stopped else "already finished"
        done = f"; wrote what its end left out: {', '.join(missing)}" if missing else ""
        return f"run {why} at step {state.step} (epoch {state.epoch}/{epochs}); nothing to do{done}"

    def _write_missing(self, weights: nn.Module | dict[str, torch.Tensor]) -> list[str]:
        assert self.run_dir is not None
        missing = []
        try:
            if not (self.run_dir / layout.WEIGHTS).is_file():
                self.write_weights(weights, self.info.model_spec)
                missing.append(layout.WEIGHTS)
            if _status(self.run_dir) != "finished":
                self.write_status("finished", self._status_info())
                missing.append(layout.STATUS)
        except OSError as err:
            raise self.failure(err) from err
        return missing


def final_weights(model: nn.Module) -> nn.Module | dict[str, torch.Tensor]:
    """What RUN_DIR/model.safetensors gets: ``model``; a sharded model's weights gathered
    into rank 0 (a collective: every process calls this)."""
    return fsdp.full_weights(model) if fsdp.is_sharded(model) else model


TEMPORARY = re.compile(r"\.(.+)\.tmp(?:-\d+)?")  # atomic_path's name for a file being written


def _status(run_dir: Path) -> str | None:
    status = read_json_object(run_dir / layout.STATUS).get("status")
    return status if isinstance(status, str) else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Configured(Protocol):
    """What :func:`python_config` reads of a Trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    scheduler: Any
    scheduler_interval: str
    options: dict[str, Any]  # the options it was given, by name
    task: str
    heads: dict[str, str] | None


def python_config(trainer: Configured) -> dict[str, Any]:
    """The configuration of a run built in Python (no config file), what a resume compares:
    the model, optimizer, loss and scheduler the Trainer was given, described, and every
    option of :class:`glassloop.options.TrainOptions` as it resolved it: its attribute of
    the same name where it keeps one (``clip_grad_norm=0`` is recorded as ``None``, off),
    and the task (a task per head: the heads')."""
    options = {name: getattr(trainer, name, value) for name, value in trainer.options.items()}
    options["task"] = trainer.heads or trainer.task
    model, optimizer, loss_fn, scheduler = (
        trainer.model,
        trainer.optimizer,
        trainer.loss_fn,
        trainer.scheduler,
    )
    recorded = {
        "model": fsdp.class_name(unwrap_model(model)),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "optimizer": type(optimizer).__name__,
        "optimizer_defaults": {k: _jsonable(v) for k, v in sorted(optimizer.defaults.items())},
        "loss_fn": stable_repr(loss_fn),
        # (a loss of the user's, edited between runs under the same name: its source's
        # digest differs, and a resume says so as for any config change)
        **_digest("loss_fn_source_sha256", loss_fn),
        "scheduler": type(scheduler).__name__ if scheduler is not None else None,
        "scheduler_interval": trainer.scheduler_interval,
        # whether the model runs compiled (the option itself may change on a resume)
        "compile": model is not unwrap_model(model),
    }
    return {**{name: _jsonable(value) for name, value in options.items()}, **recorded}


def _digest(key: str, value: Any) -> dict[str, str]:
    """``{key: digest}`` of :func:`~glassloop.storage.serialization.behaviour_digest`, or nothing
    (torch's own losses: runs written before the digest existed compare unchanged)."""
    digest = behaviour_digest(value)
    return {key: digest} if digest is not None else {}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.device):
        return str(value)
    return stable_repr(value)
