"""Experiment tracking: a run's config, metrics, report and weights in MLflow.

The run directory stays the record (config.json, metrics.csv/jsonl, checkpoints); a tracker
copies it to where a team compares runs. MLflow's client API is used as is (no wrapper
around its fluent global state, so two trainers in one process never mix their runs).

* ``backend = "mlflow"``: params are the resolved config, flattened (``optim.lr``); every
  step and epoch row's numbers are metrics at their optimizer step; at the end the report's
  files and ``model.safetensors`` are artifacts and the run's status is set. The default
  store is ``sqlite:///mlflow.db`` in the current directory (MLflow's own default: no server;
  ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows it), its artifacts in
  ``mlartifacts/`` beside the file; ``uri`` may be any MLflow tracking URI
  (``http://host:5000``).
* Rank 0 only, like every file of the run directory. A resumed run continues the same
  tracked run (its id is kept in ``RUN_DIR/tracking.json``).
* A backend that fails (server gone, disk full) never stops training: one warning, then
  tracking is off for the rest of the run; the run directory has everything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glassloop.errors import ConfigError
from glassloop.runs import read_json_object
from glassloop.serialization import dotted


@dataclass
class TrackingConfig:
    """Where a run is tracked (``[tracking]`` in a config; ``backend = ""``: nowhere)."""

    backend: str = ""  # "" (off) or "mlflow"
    uri: str = ""  # the tracking URI; "": sqlite:///mlflow.db in the current directory
    experiment: str = "glassloop"  # the MLflow experiment
    run_name: str = ""  # "": the run directory's name
    tags: dict[str, Any] = field(default_factory=dict)


class MLflowTracker:
    """One MLflow run for one glassloop run directory (see the module docstring)."""

    def __init__(self, config: TrackingConfig, warn: Callable[[str], None] = print) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ConfigError(
                "config: tracking.backend = 'mlflow' needs MLflow: pip install 'glassloop[mlflow]'"
            ) from err
        self.config = config
        self.warn = warn
        self.client = MlflowClient(tracking_uri=config.uri or "sqlite:///mlflow.db")
        self.run_id: str | None = None
        self.failed = False

    def start(self, run_dir: Path, params: dict[str, Any], *, resume: bool) -> None:
        """Create the run (or, resuming, continue the one ``tracking.json`` names) and log
        the flattened config as its params."""
        saved = read_json_object(run_dir / "tracking.json") if resume else {}
        if saved.get("run_id"):
            self.run_id = str(saved["run_id"])
            self._call(self.client.update_run, self.run_id, status="RUNNING")
            return
        experiment = self._call(self._experiment_id)
        if experiment is None:
            return
        tags = {str(k): str(v) for k, v in self.config.tags.items()}
        name = self.config.run_name or run_dir.name
        run = self._call(self.client.create_run, experiment, run_name=name, tags=tags)
        if run is None:
            return
        self.run_id = run.info.run_id
        (run_dir / "tracking.json").write_text(
            json.dumps({"backend": "mlflow", "run_id": self.run_id}), encoding="utf-8"
        )
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:6000]) for k, v in sorted(dotted(params).items())]
        for start in range(0, len(flat), 100):  # MLflow takes at most 100 params a batch
            self._call(self.client.log_batch, self.run_id, params=flat[start : start + 100])

    def log(self, row: dict[str, Any]) -> None:
        """The numbers of a metrics row, at its optimizer step."""
        if self.run_id is None or self.failed:
            return
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row.get("step") or 0)
        prefix = "step/" if row.get("kind") == "step" else ""  # a step row's loss vs an epoch's
        metrics = [
            Metric(prefix + key, float(value), now, step)
            for key, value in row.items()
            if key not in ("kind", "step") and _is_number(value)
        ]
        if metrics:
            self._call(self.client.log_batch, self.run_id, metrics=metrics)

    def finish(self, status: str, files: list[Path]) -> None:
        """Upload ``files`` as artifacts (when finished) and set the run's status."""
        if self.run_id is None or self.failed:
            return
        if status == "finished":
            for path in files:
                folder = "report" if path.parent.name == "report" else None
                self._call(self.client.log_artifact, self.run_id, str(path), folder)
        state = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self._call(self.client.set_terminated, self.run_id, status=state)

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

    def _call(self, action: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``action(*args, **kwargs)``: one backend call; the first failure turns tracking
        off with one warning."""
        if self.failed:
            return None
        try:
            return action(*args, **kwargs)
        except Exception as err:  # the backend's errors are its own (HTTP, SQL, OS)
            self.failed = True
            self.warn(
                f"warning: tracking (mlflow) failed and is off for the rest of this run; the "
                f"run directory has everything: {type(err).__name__}: {str(err)[:300]}"
            )
            return None


def make_tracker(
    config: TrackingConfig | None, warn: Callable[[str], None] = print
) -> MLflowTracker | None:
    """The tracker ``config`` asks for (``None`` when tracking is off)."""
    if config is None or not config.backend:
        return None
    if config.backend != "mlflow":
        raise ConfigError(
            f"config: tracking.backend must be '' or 'mlflow', got {config.backend!r}"
        )
    return MLflowTracker(config, warn)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
