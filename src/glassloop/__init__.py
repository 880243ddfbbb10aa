"""glassloop: a production PyTorch training loop you can read in one sitting.

The public names below are imported when first used (PEP 562), so ``import glassloop`` and
``glassloop --help`` start without torch; ``glassloop.Trainer`` imports what it needs.

>>> import glassloop
>>> {"Trainer", "evaluate", "predict", "load_model"} <= set(glassloop.__all__)
True
>>> glassloop.evaluate.__module__, glassloop.build.__module__
('glassloop.evaluation.evaluate', 'glassloop.config.assemble')
>>> set(glassloop.__all__) == {*_EXPORTS, "__version__"}
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import glassloop.tools.moved  # (an old module path names its new home)
import glassloop.tracking.launched  # noqa: F401  (the launch's moment: before any heavy import)
from glassloop._version import __version__

# Each public name and the module that defines it.
_EXPORTS = {
    "Callback": "glassloop.callbacks",
    "CheckpointConfig": "glassloop.options",
    "CheckpointError": "glassloop.errors",
    "Config": "glassloop.config.schema",
    "ConfigError": "glassloop.errors",
    "DataError": "glassloop.errors",
    "EarlyStopping": "glassloop.callbacks",
    "GlassloopError": "glassloop.errors",
    "ModelError": "glassloop.errors",
    "NonFinitePolicy": "glassloop.step.guards",
    "Predictor": "glassloop.tools.prediction",
    "Preempted": "glassloop.distributed.preemption",
    "Run": "glassloop.config.assemble",
    "RunEvaluation": "glassloop.tools.run_evaluation",
    "RunInfo": "glassloop.options",
    "TrackingConfig": "glassloop.options",
    "TrainOptions": "glassloop.options",
    "TrainState": "glassloop.state",
    "Trainer": "glassloop.loop",
    "build": "glassloop.config.assemble",
    "doctor": "glassloop.tools.checklist",
    "evaluate": "glassloop.evaluation.evaluate",
    "evaluate_run": "glassloop.tools.run_evaluation",
    "export_hf": "glassloop.storage.hugging_face",
    "export_model": "glassloop.tools.export",
    "export_onnx": "glassloop.serving.exported",
    "export_program": "glassloop.serving.exported",
    "export_run_hf": "glassloop.tools.export",
    "format_report": "glassloop.evaluation.metrics",
    "load_config": "glassloop.config.schema",
    "load_run": "glassloop.tracking.runs",
    "load_model": "glassloop.tools.export",
    "load_weights": "glassloop.storage.weights",
    "lr_find": "glassloop.tools.lr_finder",
    "predict": "glassloop.evaluation.evaluate",
    "report_run": "glassloop.tools.run_evaluation",
    "save_weights": "glassloop.storage.weights",
    "seed_everything": "glassloop.rng",
    "tune": "glassloop.tuning.sweep",
}

__all__ = [
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "EarlyStopping",
    "GlassloopError",
    "ModelError",
    "NonFinitePolicy",
    "Predictor",
    "Preempted",
    "Run",
    "RunEvaluation",
    "RunInfo",
    "TrackingConfig",
    "TrainOptions",
    "TrainState",
    "Trainer",
    "__version__",
    "build",
    "doctor",
    "evaluate",
    "evaluate_run",
    "export_hf",
    "export_model",
    "export_onnx",
    "export_program",
    "export_run_hf",
    "format_report",
    "load_config",
    "load_model",
    "load_run",
    "load_weights",
    "lr_find",
    "predict",
    "report_run",
    "save_weights",
    "seed_everything",
    "tune",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glassloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what type checkers and IDEs see
    from glassloop.callbacks import Callback, EarlyStopping
    from glassloop.config.assemble import Run, build
    from glassloop.config.schema import Config, load_config
    from glassloop.distributed.preemption import Preempted
    from glassloop.errors import CheckpointError, ConfigError, DataError, GlassloopError, ModelError
    from glassloop.evaluation.evaluate import evaluate, predict
    from glassloop.evaluation.metrics import format_report
    from glassloop.loop import Trainer
    from glassloop.options import CheckpointConfig, RunInfo, TrackingConfig, TrainOptions
    from glassloop.rng import seed_everything
    from glassloop.serving.exported import export_onnx, export_program
    from glassloop.state import TrainState
    from glassloop.step.guards import NonFinitePolicy
    from glassloop.storage.hugging_face import export_hf
    from glassloop.storage.weights import load_weights, save_weights
    from glassloop.tools.checklist import doctor
    from glassloop.tools.export import export_model, export_run_hf, load_model
    from glassloop.tools.lr_finder import lr_find
    from glassloop.tools.prediction import Predictor
    from glassloop.tools.run_evaluation import RunEvaluation, evaluate_run, report_run
    from glassloop.tracking.runs import load_run
    from glassloop.tuning.sweep import tune
