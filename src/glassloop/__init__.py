"""glassloop: a production PyTorch training loop you can read in one sitting.

>>> import glassloop
>>> sorted(glassloop.__all__)[:3]
['Callback', 'Config', 'ConfigError']
"""

from glassloop.build import Run, build
from glassloop.callbacks import Callback
from glassloop.checkpoint import load_weights, save_weights
from glassloop.config import Config, load_config
from glassloop.errors import ConfigError, DataError, GlassloopError, ModelError
from glassloop.evaluate import evaluate, predict
from glassloop.loop import Trainer
from glassloop.metrics import format_report
from glassloop.rng import seed_everything
from glassloop.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "Config",
    "ConfigError",
    "DataError",
    "GlassloopError",
    "ModelError",
    "Run",
    "TrainState",
    "Trainer",
    "__version__",
    "build",
    "evaluate",
    "format_report",
    "load_config",
    "load_weights",
    "predict",
    "save_weights",
    "seed_everything",
]
