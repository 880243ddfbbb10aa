"""Experiment tracking: a run's config, metrics, report and weights in MLflow or Weights &
Biases.

The run directory stays the record (config.json, metrics.csv/jsonl, checkpoints); a tracker
copies it to where a team compares runs. MLflow's client API is used as is (no wrapper
around its fluent global state, so two trainers in one process never mix their runs); W&B's
``Run`` object likewise (``wandb.init`` returns it, glassloop never uses ``wandb.log``).

* ``backend = "mlflow"``: params are the resolved config, flattened (``optim.lr``); every
  step and epoch row's numbers are metrics at their optimizer step; at the end the report's
  files and ``model.safetensors`` are artifacts and the run's status is set. The default
  store is ``sqlite:///mlflow.db`` in the current directory (MLflow's own default: no server;
  ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows it), its artifacts in
  ``mlartifacts/`` beside the file; ``uri`` may be any MLflow tracking URI
  (``http://host:5000``).
* ``backend = "wandb"``: the same params (the run's config), metrics (``run.log`` at the
  optimizer step), the report's files (``run.save``, the run's Files) and the weights (an
  artifact of type ``model``); ``experiment`` is the W&B project, ``uri`` the server
  (``WANDB_BASE_URL``; "": W&B's default). W&B keeps its local files in ``RUN_DIR/wandb/``;
  with ``WANDB_MODE=offline`` that is all it does (``wandb sync RUN_DIR/wandb/offline-run-*``
  uploads them later).
* Rank 0 only, like every file of the run directory. A resumed run continues the same
  tracked run (its id is kept in ``RUN_DIR/tracking.json``) and logs the steps after its
  checkpoint again, as metrics.csv has them: MLflow keeps both values of such a step, the
  resumed one logged last (:func:`check_tracked`, ``glassloop runs --tracking``, reads each
  step's last and compares it with metrics.jsonl); W&B, which keeps one value per step,
  rewinds the run to the checkpoint's step (``resume_from``) where its server allows, and
  otherwise keeps the first values, which one line at resume says.
* A backend that fails (server gone, disk full) never stops training: one warning, then
  tracking is off for the rest of the run; the run directory has everything.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glassloop.best import is_number
from glassloop.errors import ConfigError
from glassloop.options import TrackingConfig
from glassloop.run_dir import layout
from glassloop.storage.atomic import atomic_path
from glassloop.storage.redaction import redact, redacted_output, remember_secrets
from glassloop.storage.serialization import dotted
from glassloop.tracking.runs import read_json_object, read_rows
from glassloop.tracking.sinks import ROWS


class Tracker:
    """What every backend does with a run: :meth:`start` (create or continue it, log the
    params), :meth:`write` (a metrics row: a :class:`~glassloop.tracking.sinks.Destination`),
    :meth:`finish` (artifacts, status). Every call to
    the backend goes through :meth:`_call`: its first failure turns tracking off with one
    warning, and training goes on."""

    name = ""
    kinds = ROWS

    def __init__(self, config: TrackingConfig, warn: Callable[[str], None] = print) -> None:
        self.config = config
        self.warn = warn
        self.run_id: str | None = None
        self.failed = False

    def start(self, run_dir: Path, params: dict[str, Any], *, resume: bool, step: int = 0) -> None:
        """Create the run (or, resuming at ``step``, continue the one ``tracking.json``
        names) and log the flattened config as its params."""
        saved = read_json_object(run_dir / layout.TRACKING) if resume else {}
        previous = str(saved["run_id"]) if saved.get("run_id") else None
        self.run_id = self._call(self._open, run_dir, dotted(params), previous, step)
        if self.run_id is not None and previous is None:
            record = {"backend": self.name, "run_id": self.run_id, **self._where()}
            with atomic_path(run_dir / layout.TRACKING) as tmp:
                tmp.write_text(json.dumps(record))

    def write(self, row: dict[str, Any]) -> None:
        """The numbers of a metrics row, at its optimizer step (:func:`tracked_numbers`)."""
        if self.run_id is None or self.failed:
            return
        numbers = tracked_numbers(row)
        if numbers:
            self._call(self._log, numbers, int(row.get("step") or 0))

    def finish(self, status: str, files: list[Path]) -> None:
        """Upload ``files`` (when finished: the report's and the weights) and set the run's
        status."""
        if self.run_id is None or self.failed:
            return
        self._call(self._finish, status, files if status == "finished" else [])

    def _open(self, run_dir: Path, params: dict[str, Any], previous: str | None, step: int) -> str:
        raise NotImplementedError

    def _where(self) -> dict[str, str]:
        """What tracking.json keeps besides the run's id, to find it again."""
        return {}

    def _log(self, numbers: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _finish(self, status: str, files: list[Path]) -> None:
        raise NotImplementedError

    def _call(self, action: Callable[..., Any], *args: Any) -> Any:
        """``action(*args)``: one backend call; the first failure turns tracking off with
        one warning."""
        if self.failed:
            return None
        try:
            # What the backend prints meanwhile (MLflow's "View run at <tracking URI>") is
            # redacted: console output is what CI logs and Slurm's .out files keep.
            with redacted_output():
                return action(*args)
        except Exception as err:  # the backend's errors are its own (HTTP, SQL, OS, ...)
            self.failed = True
            # (redacted before it is cut: a cut secret would no longer look like one)
            reason = " ".join(redact(str(err)).split())[:300]  # (W&B's run over several lines)
            self.warn(
                redact(
                    f"warning: tracking ({self.name}) failed and is off for the rest of this "
                    f"run; the run directory has everything: {type(err).__name__}: {reason}"
                    f"{self.hint}"
                )
            )
            return None

    @property
    def hint(self) -> str:
        """What to do about a failure, when the backend's own message does not say it."""
        return ""


class MLflowTracker(Tracker):
    """One MLflow run for one glassloop run directory (see the module docstring)."""

    name = "mlflow"

    def __init__(self, config: TrackingConfig, warn: Callable[[str], None] = print) -> None:
        super().__init__(config, warn)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ConfigError(
                "config: tracking.backend = 'mlflow' needs MLflow: pip install 'glassloop[mlflow]'"
            ) from err
        self.make_client = MlflowClient
        self.client: Any = None

    @property
    def hint(self) -> str:
        return (
            f" (tracking.uri {redact(self.config.uri, uri=True)!r}: MLflow takes e.g. "
            "'sqlite:///mlflow.db' or 'http://host:5000')"
            if self.client is None
            else ""
        )

    def _open(self, run_dir: Path, params: dict[str, Any], previous: str | None, step: int) -> str:
        uri = self.config.uri or "sqlite:///mlflow.db"
        if "://" not in uri and redact(uri, uri=True) != uri:
            # MLflow (before 3) would take it for a local folder named after the secret.
            raise ValueError("a URI with credentials needs a scheme: write 'http://...@host'")
        reachable(uri)  # (a server that is down cost 4 minutes of MLflow's retries)
        client = self.make_client(tracking_uri=uri)  # (a URI it refuses: one warning)
        client.search_experiments(max_results=1)  # the store answers, or fails here
        self.client = client
        if previous is not None:
            self.client.update_run(previous, status="RUNNING")
            return previous
        tags = {str(k): str(v) for k, v in self.config.tags.items()}
        name = self.config.run_name or run_dir.name
        run = self.client.create_run(self._experiment_id(), run_name=name, tags=tags)
        run_id = str(run.info.run_id)
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for start in range(0, len(flat), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(run_id, params=flat[start : start + 100])
        return run_id

    def _log(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numbers.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def _finish(self, status: str, files: list[Path]) -> None:
        assert self.run_id is not None
        for path in files:
            folder = "report" if path.parent.name == "report" else None
            self.client.log_artifact(self.run_id, str(path), folder)
        state = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=state)

    def _where(self) -> dict[str, str]:
        """The store's URI when it holds no secret (a SQLite file: its absolute path)."""
        uri = str(self.client.tracking_uri)
        if uri.startswith("sqlite:///"):
            uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
        return {"uri": uri} if redact(uri, uri=True) == uri else {}

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.config.experiment)
        if found is not None:
            return str(found.experiment_id)
        return str(
            self.client.create_experiment(
                self.config.experiment, artifact_location=self._artifacts()
            )
        )

    def _artifacts(self) -> str | None:
        """For a SQLite store, artifacts go beside its file (``mlartifacts/``), so the store
        is one folder wherever glassloop was started; a server decides for itself."""
        uri = self.client.tracking_uri
        if not uri.startswith("sqlite:///"):
            return None
        database = Path(uri.removeprefix("sqlite:///")).resolve()
        return (database.parent / "mlartifacts").as_uri()


class WandbTracker(Tracker):
    """One W&B run for one glassloop run directory (see the module docstring)."""

    name = "wandb"

    def __init__(self, config: TrackingConfig, warn: Callable[[str], None] = print) -> None:
        super().__init__(config, warn)
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(
                "config: tracking.backend = 'wandb' needs Weights & Biases: "
                "pip install 'glassloop[wandb]'"
            ) from err
        self.wandb = wandb
        self.run: Any = None

    def _open(self, run_dir: Path, params: dict[str, Any], previous: str | None, step: int) -> str:
        # console="off": glassloop's own output stays as it is (W&B would wrap stdout).
        settings = self.wandb.Settings(console="off", silent=True)
        if self.config.uri:
            settings.base_url = self.config.uri  # checked by W&B: a bad one fails here
        common: dict[str, Any] = {
            "project": self.config.experiment,
            "name": self.config.run_name or run_dir.name,
            "tags": [f"{k}={v}" for k, v in self.config.tags.items()],
            "config": params,
            "dir": str(run_dir),
            "settings": settings,
            "reinit": "create_new",
        }
        offline = os.environ.get("WANDB_MODE", "online") in ("offline", "dryrun", "disabled")
        if previous is not None and not offline:
            # W&B keeps one value per step and drops a step below its last: rewound to the
            # checkpoint's step, the steps logged again after it are the resumed run's.
            try:
                self.run = self.wandb.init(**common, resume_from=f"{previous}?_step={step}")
                return str(self.run.id)
            except Exception:  # (a server without rewinding: continued as it is, below)
                pass
        self.run = self.wandb.init(**common, id=previous, resume="allow" if previous else None)
        if previous is not None:
            self.warn(
                f"tracking (wandb): the run goes on from step {step}, but W&B keeps the "
                "values it already has for the steps after it that the stopped run logged "
                "(it keeps one per step; rewinding, resume_from, needs a server that allows "
                "it, and an offline run); metrics.csv has the resumed ones"
            )
        return str(self.run.id)

    def _log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def _finish(self, status: str, files: list[Path]) -> None:
        weights = [path for path in files if path.suffix == ".safetensors"]
        for path in files:
            if path not in weights:
                self.run.save(str(path), base_path=str(path.parent.parent), policy="now")
        if weights:
            artifact = self.wandb.Artifact(f"{self.run.name}-model", type="model")
            for path in weights:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.summary["status"] = status
        self.run.finish(exit_code={"finished": 0, "interrupted": 130}.get(status, 1))


def reachable(uri: str, timeout: float = 5.0) -> None:
    """Raise ``ConnectionError`` when an ``http(s)`` tracking server does not accept a
    connection within ``timeout`` seconds (other URIs are local: nothing to check)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(
            f"the tracking server at {parts.hostname}:{port} does not answer ({err})"
        ) from None


TRACKERS: dict[str, type[Tracker]] = {"mlflow": MLflowTracker, "wandb": WandbTracker}


def make_tracker(
    config: TrackingConfig | None, warn: Callable[[str], None] = print
) -> Tracker | None:
    """The tracker ``config`` asks for (``None`` when tracking is off)."""
    if config is None or not config.backend:
        return None
    remember_secrets(config.uri)  # (the library's own messages may quote them)
    if config.backend not in TRACKERS:
        raise ConfigError(
            "config: tracking.backend must be '', 'mlflow' or 'wandb', "
            f"got {redact(config.backend)!r}"
        )
    return TRACKERS[config.backend](config, warn)


def _is_number(value: Any) -> bool:
    return is_number(value) and value == value  # (NaN: not sent, backends refuse it)


def tracked_numbers(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row as a tracker logs them at the row's step: a step row's
    as ``step/*`` (its loss is not the epoch's), NaN left out (backends refuse it).

    >>> tracked_numbers({"kind": "step", "step": 3, "loss": 0.5, "lr": None})
    {'step/loss': 0.5}
    """
    prefix = "step/" if row.get("kind") == "step" else ""
    return {
        prefix + key: float(value)
        for key, value in row.items()
        if key not in ("kind", "step") and _is_number(value)
    }


def check_tracked(run_dir: Path, uri: str = "") -> tuple[bool, str]:
    """Whether the run's MLflow history says what its ``metrics.jsonl`` says, and a line
    about it. Each step's value is the last logged (a resumed run logs the steps after its
    checkpoint again); a number in one and not the other, or another value, is a
    difference (the first three are named); wall-clock numbers (samples/s, seconds) are
    each run's own measure and not compared. ``uri``: the store (default: what
    ``tracking.json`` recorded, then ``MLFLOW_TRACKING_URI``)."""
    saved = read_json_object(run_dir / layout.TRACKING)
    backend, run_id = saved.get("backend"), saved.get("run_id")
    if backend != "mlflow" or not run_id:
        what = "no tracked run" if not run_id else f"tracked in {backend}: not read here"
        return True, f"{run_dir.name}: {what}"
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise ConfigError("runs --tracking reads MLflow: pip install 'glassloop[mlflow]'") from err

    uri = uri or str(saved.get("uri") or os.environ.get("MLFLOW_TRACKING_URI") or "")
    if not uri:  # (MLflow's default would make a store here: never one that is not ours)
        return False, (
            f"{run_dir.name}: mlflow run {run_id}: its store is not recorded (its URI held "
            "a secret, or an older glassloop): set MLFLOW_TRACKING_URI"
        )
    tracked: dict[tuple[str, int], float] = {}
    try:
        with redacted_output():
            client = MlflowClient(tracking_uri=uri)
            for key in client.get_run(run_id).data.metrics:
                history = client.get_metric_history(run_id, key)
                for metric in sorted(history, key=lambda m: m.timestamp):  # (last wins)
                    tracked[(key, int(metric.step))] = float(metric.value)
    except Exception as err:  # (the store's own errors: HTTP, SQL, a run it does not have)
        reason = " ".join(redact(str(err)).split())[:200]
        return False, f"{run_dir.name}: mlflow run {run_id} could not be read: {reason}"
    local: dict[tuple[str, int], float] = {}
    for kind in ("step", "val", "epoch"):  # (a line a kill cut short: skipped)
        for row in read_rows(run_dir, kind):
            for key, value in tracked_numbers(row).items():
                local[(key, int(row.get("step") or 0))] = value
    from glassloop.step.throughput import (
        TIMING,
    )  # (wall-clock numbers: each run's own, not compared)

    differ = [
        f"{key} at step {step}: {tracked.get((key, step))} tracked, {local.get((key, step))} "
        "in metrics.jsonl"
        for key, step in sorted(tracked.keys() | local.keys(), key=lambda k: (k[1], k[0]))
        if tracked.get((key, step)) != local.get((key, step))
        and key.removeprefix("step/") not in TIMING
    ]
    steps = len({step for _, step in local})
    if not differ:
        return True, (
            f"{run_dir.name}: mlflow run {run_id}: {len(local)} numbers at {steps} steps, "
            "each step's last value equal to metrics.jsonl"
        )
    return False, (
        f"{run_dir.name}: mlflow run {run_id}: {len(differ)} numbers differ from "
        f"metrics.jsonl: {'; '.join(differ[:3])}"
    )
