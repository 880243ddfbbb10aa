"""The run configuration: TOML parsed with ``tomllib`` into typed, validated dataclasses.

Sections and keys (every key has a default; see the README's config reference)::

    [model]      name, hidden, dropout, target, kwargs
    [data]       name, path, batch_size, eval_batch_size, shuffle, num_workers,
                 val_fraction, num_samples, num_features, num_classes, seed
    [optim]      name, lr, and any keyword argument of that torch.optim class
    [scheduler]  name, interval, and any keyword argument of that lr_scheduler class
    [loss]       name, label_smoothing, pos_weight, delta, beta
    [train]      epochs, seed, device, log_every, progress, precision, grad_accum_steps,
                 loss_weighting, ignore_index, clip_grad_norm, clip_grad_value, nonfinite,
                 max_nonfinite_skips, loss_spike, ema_decay, compile, strategy, dist_timeout_s,
                 tensorboard, task, metrics, validate_every_n_steps, limit_batches,
                 deterministic, activation_checkpointing
    [checkpoint] every_n_steps, every_n_epochs, keep_last, monitor, mode
    [early_stopping] monitor, patience, min_delta, mode
    [tracking]   backend, uri, experiment, run_name, tags

``--set section.key=value`` overrides any key; the value is read as TOML (``3e-4``,
``true``, ``[256, 128]``) and falls back to a plain string (``--set data.name=digits``).
"""

from __future__ import annotations

import json
import sys
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from glassloop.checkpointer import CheckpointConfig
from glassloop.data.options import DataConfig as DataConfig
from glassloop.errors import ConfigError
from glassloop.guards import check_loss_spike
from glassloop.losses import LossConfig as LossConfig
from glassloop.metric_names import check_metric_name
from glassloop.models import BUILT_IN_KEYS
from glassloop.models import ModelConfig as ModelConfig
from glassloop.optimizers import OptimConfig as OptimConfig
from glassloop.optimizers import SchedulerConfig as SchedulerConfig
from glassloop.optimizers import optimizer_kwargs, scheduler_kwargs
from glassloop.tracking import TrackingConfig
from glassloop.validation import (
    AT_LEAST_0,
    AT_LEAST_1,
    FRACTION,
    TRAINER_RULES,
    Range,
    check_choice,
    check_range,
    check_type,
    unknown_key,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class TrainConfig:
    epochs: int = 10
    seed: int = 0
    device: str = "auto"
    log_every: int = 100
    progress: str = "auto"
    precision: str = "32"  # "32", "bf16" (autocast) or "fp16" (autocast + GradScaler)
    grad_accum_steps: int = 1
    loss_weighting: str = "samples"  # or "tokens": weight micro-batches by non-ignored labels
    ignore_index: int = -100  # the label that "tokens" weighting does not count
    clip_grad_norm: float = 0.0  # 0: off
    clip_grad_value: float = 0.0  # 0: off
    nonfinite: str = "raise"  # "strict": checked before each step; "skip": dropped
    max_nonfinite_skips: int = 10  # "skip": stop after this many in a row
    loss_spike: float = 0.0  # 0: off; e.g. 10: stop at a loss 10x the median of the 20 before
    ema_decay: float = 0.0  # 0: off; e.g. 0.999: evaluate and export an EMA of the weights
    compile: bool = False  # torch.compile the model (checkpoints load with or without it)
    compile_mode: str = "default"  # torch.compile mode: "reduce-overhead", "max-autotune", ...
    compile_dynamic: bool = False  # false: static shapes (a resumed run compiles the same)
    strategy: str = "auto"  # several processes (torchrun): "auto"/"ddp" = DDP; "fsdp" = FSDP2
    dist_timeout_s: float = 300.0  # a collective waiting longer (a dead process) fails the job
    tensorboard: bool = False  # also write RUN_DIR/tensorboard/ (glassloop[tensorboard])
    task: str = "auto"  # auto: from loss.name; classification, multilabel, regression, ...
    outputs: str = "auto"  # "probabilities": the model ends in a sigmoid/softmax; or "logits"
    metrics: list[str] = field(default_factory=list)  # by name, e.g. ["top5_accuracy", "auroc"]
    validate_every_n_steps: int = 0  # 0: validate at epoch ends only
    limit_batches: int = 0  # 0: all; N: at most N training and N validation batches an epoch
    deterministic: bool | str = False  # true: torch's deterministic algorithms; "warn": warn only
    activation_checkpointing: list[str] = field(default_factory=list)  # module class names


@dataclass
class EarlyStoppingConfig:
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs."""

    monitor: str = ""  # "": off; "val_loss", "val_accuracy" or "train_loss"
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "auto"  # "min", "max"; auto: max for accuracy, else min


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "scheduler": SchedulerConfig,
    "loss": LossConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "early_stopping": EarlyStoppingConfig,
    "tracking": TrackingConfig,
}
# Sections whose unknown keys are keyword arguments of the class they name.
OPEN_SECTIONS = {"optim", "scheduler"}
CHOICES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("train", "progress"): ("auto", "bar", "lines", "none"),
    ("data", "name"): (
        "mnist-5k",
        "digits",
        "synthetic",
        "npz",
        "csv",
        "image-folder",
        "mnist",
        "fashion-mnist",
        "cifar10",
        "text-csv",
        "parquet",
    ),
    ("data", "channels"): (0, 1, 3),
    ("model", "encoder"): ("gru", "transformer"),
    ("model", "name"): ("mlp", "cnn", "text-classifier"),
    ("train", "strategy"): ("auto", "ddp", "fsdp", "dp"),
    ("checkpoint", "mode"): ("auto", "min", "max"),
    ("loss", "name"): (
        "cross_entropy", "nll", "bce_with_logits", "mse", "l1", "huber", "smooth_l1",
    ),
    ("train", "task"): ("auto", "classification", "multilabel", "regression", "language-model"),
    ("train", "outputs"): ("auto", "logits", "probabilities"),
    ("early_stopping", "mode"): ("auto", "min", "max"),
    ("tracking", "backend"): ("", "mlflow", "wandb"),
    ("train", "nonfinite"): ("raise", "strict", "skip"),
    ("train", "deterministic"): (False, True, "warn"),
    ("train", "compile_mode"): (
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
    ),
}  # fmt: skip
# The [train] keys the Trainer checks too: one table for both (validation.TRAINER_RULES).
_TRAINER_KEYS = {
    ("scheduler", "interval") if name == "scheduler_interval" else ("train", name): rule
    for name, rule in TRAINER_RULES.items()
}
CHOICES.update({key: rule for key, rule in _TRAINER_KEYS.items() if isinstance(rule, tuple)})


# Every numeric key's accepted values, checked once, where the config is read. A value
# outside them would crash later with a traceback (num_workers = -1, T_max = 0), allocate
# without bound (hidden = [10**12]) or train silently wrong (hidden = [0]).
RANGES: dict[tuple[str, str], Range] = {
    ("model", "hidden"): Range(1, 2**20),
    ("model", "dropout"): FRACTION,
    ("model", "embed_dim"): Range(1, 2**16),
    ("model", "num_layers"): Range(1, 1024),
    ("model", "num_heads"): Range(1, 1024),
    ("data", "batch_size"): Range(1, 2**31),
    ("data", "eval_batch_size"): Range(0, 2**31),
    ("data", "num_workers"): Range(0, 256),
    ("data", "in_memory_mb"): AT_LEAST_0,
    ("data", "val_fraction"): Range(0.0, 1.0, open_low=True, open_high=True),
    ("data", "num_samples"): Range(1, 2**40),
    ("data", "num_features"): Range(1, 2**24),
    ("data", "num_classes"): Range(2, 2**24),
    ("data", "image_size"): Range(0, 2**15),
    ("data", "vocab_size"): Range(2, 2**24),
    ("data", "max_length"): Range(1, 2**24),
    ("data", "seed"): Range(0, 2**32 - 1),
    ("optim", "lr"): Range(0, open_low=True),  # lr = 0 trains nothing, silently
    ("train", "epochs"): AT_LEAST_1,
    ("train", "seed"): Range(0, 2**63 - 1),
    ("train", "dist_timeout_s"): Range(0, open_low=True),
    ("checkpoint", "every_n_steps"): AT_LEAST_0,
    ("checkpoint", "every_n_epochs"): AT_LEAST_0,
    ("checkpoint", "keep_last"): AT_LEAST_0,
    ("early_stopping", "patience"): AT_LEAST_1,
    ("early_stopping", "min_delta"): AT_LEAST_0,
    ("loss", "label_smoothing"): FRACTION,
    ("loss", "pos_weight"): Range(0.0, open_low=True),
    ("loss", "delta"): Range(0.0, open_low=True),
    ("loss", "beta"): Range(0.0, open_low=True),
    **{key: rule for key, rule in _TRAINER_KEYS.items() if isinstance(rule, Range)},
}


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Read a TOML (or a run's ``config.json``), apply ``--set`` overrides, validate.

    >>> load_config(None, ["optim.lr=3e-4"]).optim.lr
    0.0003
    >>> try:
    ...     load_config(None, ["optim.learning_rate=1"])
    ... except ConfigError as err:
    ...     print(err)
    config: unknown key 'optim.learning_rate' (did you mean 'optim.lr'?)
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_file(Path(path))
        beside_the_file(raw, Path(path).parent)
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def beside_the_file(raw: dict[str, Any], folder: Path) -> None:
    """Relative paths in a config file (``data.path``, ``data.tokenizer``, ``data.root``, a
    file ``model.target``) name files next to that file, wherever glassloop is started: each
    one found there becomes that path. One not found there is left as written (looked up
    from the current directory), as is every path of a file in the current directory, and
    every ``--set`` value."""
    if folder.resolve() == Path.cwd().resolve():
        return
    data, model = raw.get("data"), raw.get("model")
    for section, key in ((data, "path"), (data, "tokenizer"), (data, "root")):
        value = section.get(key) if isinstance(section, dict) else None
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        if (folder / value).exists():
            section[key] = str(folder / value)  # type: ignore[index]
    target = model.get("target") if isinstance(model, dict) else None
    if isinstance(target, str) and ":" in target:
        module, _, name = target.rpartition(":")
        if module.endswith(".py") and not Path(module).is_absolute() and (folder / module).exists():
            model["target"] = f"{folder / module}:{name}"  # type: ignore[index]


def read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config: file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config: '{path}' is not UTF-8 text (byte {err.start}); save it as UTF-8"
        ) from err
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"config: '{path}' is not valid {kind}: {err}") from err
    except RecursionError as err:
        raise ConfigError(f"config: '{path}' is nested too deeply to be a config") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config: '{path}' must hold a table of sections")
    return data


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML if it parses (numbers, booleans, lists), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(
            f"config: --set expects section.key=value (e.g. optim.lr=3e-4), got {item!r}"
        )
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config: --set {key}: '{part}' is not a table")
        node = child
    node[leaf] = parse_value(text.strip())


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a nested dict (TOML-shaped) into a :class:`Config`."""
    for section in raw:
        if section not in SECTIONS:
            raise unknown_key("", section, list(SECTIONS))
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config: '{section}' must be a table ([{section}]), got a value")
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values = dict(raw.get(section, {}))
        hints = typing.get_type_hints(cls)
        names = [f.name for f in fields(cls) if f.name != "kwargs" or section == "model"]
        kwargs: dict[str, Any] = {}
        typed: dict[str, Any] = {}
        for key, value in values.items():
            if key in names:
                typed[key] = check_type(f"{section}.{key}", value, hints[key])
            elif section in OPEN_SECTIONS:
                kwargs[key] = value
            else:
                raise unknown_key(section, key, names)
        for (sec, key), choices in CHOICES.items():
            if sec == section and key in typed:
                check_choice(f"{section}.{key}", typed[key], choices)
        for key, value in typed.items():
            if (section, key) in RANGES:
                check_range(f"{section}.{key}", value, RANGES[section, key])
        obj = cls(**typed)
        if section == "optim":
            obj.kwargs = optimizer_kwargs(obj.name, kwargs)
        elif section == "scheduler":
            obj.kwargs = scheduler_kwargs(obj.name, kwargs)
        built[section] = obj
    cfg = Config(**built)
    for section in ("checkpoint", "early_stopping"):
        monitor = getattr(cfg, section).monitor
        if monitor and monitor != "train_loss" and not monitor.startswith("val_"):
            raise ConfigError(
                f"config: {section}.monitor must be 'train_loss' or a validation metric "
                f"('val_loss', 'val_accuracy', 'val_r2', ...), got {monitor!r}"
            )
    check_loss_spike(cfg.train.loss_spike)  # 0 or over 1 (a Range cannot say "or")
    if cfg.model.kwargs and not cfg.model.target:  # (it would be ignored)
        keys = ", ".join(f"model.{key}" for key in BUILT_IN_KEYS.get(cfg.model.name, ()))
        raise ConfigError(
            f"config: model.kwargs is for a model.target model only; the built-in "
            f"{cfg.model.name!r} takes {keys} (set those instead), or set model.target = "
            "'package.module:Class'"
        )
    for name in cfg.train.metrics:
        check_metric_name(name, config_task(cfg))
    if cfg.scheduler.name == "warmup_cosine":
        if "interval" not in raw.get("scheduler", {}):
            cfg.scheduler.interval = "step"  # it is defined in optimizer steps
        elif cfg.scheduler.interval != "step":
            raise ConfigError(
                "config: scheduler 'warmup_cosine' is defined in optimizer steps: set "
                "scheduler.interval = 'step'"
            )
    return cfg


# The task each loss implies when train.task is "auto".
LOSS_TASKS = {
    "cross_entropy": "classification", "nll": "classification",
    "bce_with_logits": "multilabel",
    "mse": "regression", "l1": "regression", "huber": "regression", "smooth_l1": "regression",
}  # fmt: skip


def config_task(cfg: Config) -> str:
    """``train.task``, or the task ``loss.name`` implies."""
    return cfg.train.task if cfg.train.task != "auto" else LOSS_TASKS[cfg.loss.name]


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config in the shape of its TOML file (optimizer/scheduler kwargs flattened), so
    ``load_config`` reads it back unchanged."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        values = asdict(getattr(cfg, section))
        if section in OPEN_SECTIONS:
            values.update(values.pop("kwargs"))
        out[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return out
