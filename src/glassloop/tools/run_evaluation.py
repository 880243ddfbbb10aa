"""Evaluate a finished run again from its files: rebuild its data and model from the config
it recorded, load its weights and evaluate them on its validation data (``glassloop eval``,
:func:`evaluate_run`), or rewrite its report with that evaluation (``glassloop report``,
:func:`report_run`). No optimizer, no Trainer, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from glassloop.best import is_number
from glassloop.errors import GlassloopError, writing
from glassloop.run_dir import layout

if TYPE_CHECKING:
    from glassloop.config.assemble import Built
    from glassloop.tools.export import Weights


@dataclass
class RunEvaluation:
    """A run's weights evaluated on its validation data; ``str()`` of it is what
    ``glassloop eval`` prints."""

    weights: Path  # the file (or checkpoint directory) the weights were read from
    num_samples: int  # in the validation set
    task: str  # what the model was trained to do (glassloop.tasks)
    metrics: dict[str, Any]  # glassloop.evaluate()'s result: loss, accuracy, report, ...
    class_names: list[str]

    def __str__(self) -> str:
        from glassloop.evaluation.metrics import format_report

        lines = [
            f"weights: {self.weights}",
            f"validation samples: {self.num_samples}",
            f"task: {self.task}",
        ]
        for name, value in self.metrics.items():
            if is_number(value):
                lines.append(
                    f"{name}: {100 * value:.2f}%" if name == "accuracy" else f"{name}: {value:.6g}"
                )
        if "report" in self.metrics:
            report = format_report(
                self.metrics["report"], self.metrics["accuracy"], self.class_names
            )
            lines += ["", report]
        return "\n".join(lines)


def evaluate_run(
    path: str | Path, overrides: Sequence[str] = (), *, trust_code: bool = False
) -> RunEvaluation:
    """Evaluate the weights at ``path`` (a run directory: its final weights, else its newest
    valid checkpoint; a checkpoint directory; a ``.safetensors`` file written by
    :func:`glassloop.export_model`) on the validation data of the run that made them, rebuilt
    from its recorded config with ``overrides`` (``"data.eval_batch_size=500"``) applied. An
    EMA run's EMA weights are evaluated, as training evaluated them. ``trust_code``: allow a
    config whose ``model.target`` names a class to import (importing runs code).

    >>> import tempfile
    >>> import glassloop
    >>> tmp = tempfile.TemporaryDirectory()
    >>> run_dir = Path(tmp.name) / "run"
    >>> cfg = glassloop.load_config(None, ["data.name=synthetic", "data.num_samples=200",
    ...                                    "train.epochs=1", "train.progress=none"])
    >>> run = glassloop.build(cfg, run_dir=run_dir)
    >>> _ = run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    >>> result = evaluate_run(run_dir)
    >>> result.task, result.num_samples, 0 <= result.metrics["accuracy"] <= 1
    ('classification', 40, True)
    >>> print(str(result).splitlines()[1])  # print(result): what glassloop eval prints
    validation samples: 40
    >>> tmp.cleanup()
    """
    parts, weights, metrics = _evaluated(Path(path), overrides, trust_code)
    return RunEvaluation(
        weights=weights.path,
        num_samples=len(cast(Sized, parts.val_loader.dataset)),  # (all a config builds have one)
        task=parts.task,
        metrics=metrics,
        class_names=parts.data.class_names,
    )


def report_run(run_dir: str | Path, *, trust_code: bool = False) -> Path:
    """Evaluate the final weights of the run in ``run_dir`` on its validation data (as
    :func:`evaluate_run`) and (re)write ``run_dir/report/``: its learning curves, the
    confusion matrix and per-class report (a regression's predicted-vs-true plot) and an
    index.html showing it all; returns index.html. A run trained from Python (a ``Trainer``
    with ``run_dir``) gets the report of its files, without a fresh evaluation: its model
    and data live in the user's code.

    >>> import tempfile
    >>> import glassloop
    >>> tmp = tempfile.TemporaryDirectory()
    >>> run_dir = Path(tmp.name) / "run"
    >>> cfg = glassloop.load_config(None, ["data.name=synthetic", "data.num_samples=200",
    ...                                    "train.epochs=1", "train.progress=none"])
    >>> run = glassloop.build(cfg, run_dir=run_dir)
    >>> _ = run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    >>> report_run(run_dir) == run_dir / layout.REPORT / "index.html"
    True
    >>> tmp.cleanup()
    """
    from glassloop.data.splits import Splits
    from glassloop.tracking.report import write_report
    from glassloop.tracking.runs import read_json

    run_dir = Path(run_dir)
    if not (run_dir / layout.CONFIG).is_file():
        raise GlassloopError(f"report: '{run_dir}' is not a run directory (no config.json)")
    written = writing("report", run_dir / layout.REPORT, "the run's own files are unchanged")
    try:  # (unreadable is an error: never taken for a run made in Python)
        config = read_json(run_dir / layout.CONFIG)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise GlassloopError(f"report: '{run_dir / layout.CONFIG}' is unreadable: {err}") from None
    if made_in_python(config):
        # Its model and data live in the user's code: the report of its files (curves,
        # metrics), without a fresh evaluation.
        with written:
            return write_report(run_dir)
    parts, _, evaluation = _evaluated(run_dir, [], trust_code)
    pairs = None
    if parts.task == "regression" and isinstance(parts.data, Splits):
        from glassloop.evaluation.evaluate import predict

        prediction = predict(parts.model, parts.data.x_val, task="regression", device=parts.device)
        pairs = (prediction, parts.data.y_val)
    with written:  # (a read-only run directory: exit 3, as docs/exit-codes.md says)
        return write_report(
            run_dir,
            evaluation=evaluation,
            class_names=parts.data.class_names,
            predicted_vs_true=pairs,
        )


def made_in_python(config: Any) -> bool:
    """A run directory of a ``Trainer`` built in Python: its config.json describes the
    trainer (``"model": "Sequential"``), not a glassloop config with a ``[model]`` table.

    >>> made_in_python({"model": "Sequential"}), made_in_python({"model": {"name": "mlp"}})
    (True, False)
    """
    return isinstance(config, dict) and not isinstance(config.get("model"), dict)


def _evaluated(
    source: Path, overrides: Sequence[str], trust_code: bool
) -> tuple[Built, Weights, dict[str, Any]]:
    """Rebuild the run that made ``source`` (:func:`rebuilt`) and evaluate its weights on
    its validation data; returns the parts, the weights and the result."""
    from glassloop.evaluation.evaluate import evaluate
    from glassloop.precision import autocast

    parts, weights = rebuilt(source, overrides, trust_code)
    with autocast(parts.config.train.precision, parts.device):  # as training evaluated
        result = evaluate(
            parts.model,
            parts.val_loader,
            parts.loss_fn,
            task=parts.task,
            device=parts.device,
            ignore_index=parts.config.train.ignore_index,
            metrics=parts.config.train.metrics,
        )
    return parts, weights, result


def rebuilt(
    source: str | Path, overrides: Sequence[str] = (), trust_code: bool = False, who: str = "eval"
) -> tuple[Built, Weights]:
    """The data and model of the run that made ``source``, rebuilt from its recorded config
    with ``overrides``, its weights (the EMA weights for an EMA run) loaded: what ``eval``
    evaluates and ``export`` exports."""
    from glassloop.config.assemble import build_parts
    from glassloop.config.schema import apply_override, from_dict, require_trust
    from glassloop.storage.weights import load_onto
    from glassloop.tools.export import check_on_meta, model_description, read_weights
    from glassloop.tracking.provenance import recorded_folder

    source = Path(source)
    weights = read_weights(source)
    config = weights.config
    if config is None:
        raise GlassloopError(
            f"{who}: '{source}' does not say which data it was trained on (no config)"
        )
    if made_in_python(config):
        raise GlassloopError(
            f"{who}: '{source}' was trained from Python (Trainer(..., run_dir=...)): no file "
            "says how to rebuild its model and data. Evaluate it in Python: "
            "glassloop.load_weights(model, 'RUN_DIR/model.safetensors') and "
            "glassloop.evaluate(model, loader, loss_fn)"
        )
    require_trust(config, source, trust_code)
    for item in overrides:
        apply_override(config, item)
    cfg = from_dict(config)
    if "glassloop.model" in weights.metadata:  # (the config's model against the file's shapes)
        check_on_meta(cfg.model, model_description(weights), weights)
    # (Its relative paths, from here or from where the run was started.)
    parts = build_parts(cfg, files_from=recorded_folder(weights.path))
    load_onto(parts.model, weights.tensors, weights.path, weights.base)  # (a frozen base: its own)
    parts.model.to(parts.device)
    return parts, weights
