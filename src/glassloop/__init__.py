"""glassloop: a production PyTorch training loop you can read in one sitting.

The public names below are imported when first used (PEP 562), so ``import glassloop`` and
``glassloop --help`` start without torch; ``glassloop.Trainer`` imports what it needs.

>>> import glassloop
>>> {"Trainer", "evaluate", "predict", "load_model"} <= set(glassloop.__all__)
True
>>> glassloop.evaluate.__module__, glassloop.build.__module__
('glassloop.evaluation', 'glassloop.assemble')
>>> set(glassloop.__all__) == {*_EXPORTS, "__version__"}
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import glassloop.launched  # noqa: F401  (the launch's moment: before any heavy import)
from glassloop._version import __version__

# Each public name and the module that defines it.
_EXPORTS = {
    "Callback": "glassloop.callbacks",
    "CheckpointConfig": "glassloop.options",
    "CheckpointError": "glassloop.errors",
    "Config": "glassloop.config",
    "ConfigError": "glassloop.errors",
    "DataError": "glassloop.errors",
    "EarlyStopping": "glassloop.callbacks",
    "GlassloopError": "glassloop.errors",
    "ModelError": "glassloop.errors",
    "NonFinitePolicy": "glassloop.guards",
    "Predictor": "glassloop.prediction",
    "Preempted": "glassloop.preemption",
    "Run": "glassloop.assemble",
    "RunEvaluation": "glassloop.run_evaluation",
    "RunInfo": "glassloop.options",
    "TrackingConfig": "glassloop.options",
    "TrainOptions": "glassloop.options",
    "TrainState": "glassloop.state",
    "Trainer": "glassloop.loop",
    "build": "glassloop.assemble",
    "doctor": "glassloop.checklist",
    "evaluate": "glassloop.evaluation",
    "evaluate_run": "glassloop.run_evaluation",
    "export_hf": "glassloop.hugging_face",
    "export_model": "glassloop.export",
    "export_run_hf": "glassloop.export",
    "format_report": "glassloop.metrics",
    "load_config": "glassloop.config",
    "load_model": "glassloop.export",
    "load_weights": "glassloop.weights",
    "lr_find": "glassloop.lr_finder",
    "predict": "glassloop.evaluation",
    "report_run": "glassloop.run_evaluation",
    "save_weights": "glassloop.weights",
    "seed_everything": "glassloop.rng",
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
    "export_run_hf",
    "format_report",
    "load_config",
    "load_model",
    "load_weights",
    "lr_find",
    "predict",
    "report_run",
    "save_weights",
    "seed_everything",
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
    from glassloop.assemble import Run, build
    from glassloop.callbacks import Callback, EarlyStopping
    from glassloop.checklist import doctor
    from glassloop.config import Config, load_config
    from glassloop.errors import CheckpointError, ConfigError, DataError, GlassloopError, ModelError
    from glassloop.evaluation import evaluate, predict
    from glassloop.export import export_model, export_run_hf, load_model
    from glassloop.guards import NonFinitePolicy
    from glassloop.hugging_face import export_hf
    from glassloop.loop import Trainer
    from glassloop.lr_finder import lr_find
    from glassloop.metrics import format_report
    from glassloop.options import CheckpointConfig, RunInfo, TrackingConfig, TrainOptions
    from glassloop.prediction import Predictor
    from glassloop.preemption import Preempted
    from glassloop.rng import seed_everything
    from glassloop.run_evaluation import RunEvaluation, evaluate_run, report_run
    from glassloop.state import TrainState
    from glassloop.weights import load_weights, save_weights
