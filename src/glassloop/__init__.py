"""glassloop: a production PyTorch training loop you can read in one sitting.

>>> import glassloop
>>> {"Trainer", "evaluate", "predict", "load_model"} <= set(glassloop.__all__)
True
"""

from glassloop.build import Run, build
from glassloop.callbacks import Callback
from glassloop.checkpoint import CheckpointError, load_weights, save_weights
from glassloop.config import Config, load_config
from glassloop.errors import ConfigError, DataError, GlassloopError, ModelError
from glassloop.evaluate import evaluate, predict
from glassloop.export import export_model, load_model
from glassloop.loop import Trainer
from glassloop.metrics import format_report
from glassloop.prediction import Predictor
from glassloop.preemption import Preempted
from glassloop.rng import seed_everything
from glassloop.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "GlassloopError",
    "ModelError",
    "Predictor",
    "Preempted",
    "Run",
    "TrainState",
    "Trainer",
    "__version__",
    "build",
    "evaluate",
    "export_model",
    "format_report",
    "load_config",
    "load_model",
    "load_weights",
    "predict",
    "save_weights",
    "seed_everything",
]
