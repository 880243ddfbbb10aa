"""The run configuration (a TOML file or a run's config.json) and what it builds: the schema
(:mod:`glassloop.config.schema`, re-exported here, torch-free: ``from glassloop.config import
load_config``), its sections, and the model, loss, optimizer and scheduler by name."""

from glassloop.config.schema import OPEN_SECTIONS as OPEN_SECTIONS
from glassloop.config.schema import SECTIONS as SECTIONS
from glassloop.config.schema import CheckpointConfig as CheckpointConfig
from glassloop.config.schema import Config as Config
from glassloop.config.schema import DataConfig as DataConfig
from glassloop.config.schema import EarlyStoppingConfig as EarlyStoppingConfig
from glassloop.config.schema import LossConfig as LossConfig
from glassloop.config.schema import ModelConfig as ModelConfig
from glassloop.config.schema import OptimConfig as OptimConfig
from glassloop.config.schema import SchedulerConfig as SchedulerConfig
from glassloop.config.schema import TrackingConfig as TrackingConfig
from glassloop.config.schema import TrainConfig as TrainConfig
from glassloop.config.schema import apply_override as apply_override
from glassloop.config.schema import config_task as config_task
from glassloop.config.schema import from_dict as from_dict
from glassloop.config.schema import load_config as load_config
from glassloop.config.schema import to_dict as to_dict
