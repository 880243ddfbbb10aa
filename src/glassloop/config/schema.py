"""The run configuration: TOML parsed with ``tomllib`` into typed, validated dataclasses.

Sections and keys (every key has a default; docs/config.md, generated from these
dataclasses, gives each one's type, default and description)::

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

from glassloop.config.sections import BUILT_IN_KEYS, DEFAULT_OPTIM_KWARGS, LOSS_TASKS, TASK_LOSSES
from glassloop.config.sections import LossConfig as LossConfig
from glassloop.config.sections import ModelConfig as ModelConfig
from glassloop.config.sections import OptimConfig as OptimConfig
from glassloop.config.sections import SchedulerConfig as SchedulerConfig
from glassloop.data.options import DataConfig as DataConfig
from glassloop.errors import ConfigError, ModelError
from glassloop.evaluation.metric_names import check_metric_name
from glassloop.options import CheckpointConfig as CheckpointConfig
from glassloop.options import EarlyStoppingConfig as EarlyStoppingConfig
from glassloop.options import TrackingConfig as TrackingConfig
from glassloop.options import TrainConfig as TrainConfig
from glassloop.options import rules
from glassloop.rules import Range, check_choice, check_range, check_type, loss_fits, unknown_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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
# Each key's accepted values, declared on its section's dataclass with
# glassloop.options.option ([train] is the Trainer's table of options: the Trainer checks its
# arguments by the same) and checked once, where the config is read. A value outside them
# would crash later with a traceback (num_workers = -1), allocate without bound
# (hidden = [10**12]) or train silently wrong (hidden = [0]).
_RULES = {
    (section, name): rule for section, cls in SECTIONS.items() for name, rule in rules(cls).items()
}
CHOICES: dict[tuple[str, str], tuple[Any, ...]] = {
    **{key: rule for key, rule in _RULES.items() if isinstance(rule, tuple)},
    # (the Trainer takes "custom" and a task per head too; a config names one of these)
    ("train", "task"): ("auto", "classification", "multilabel", "regression", "language-model"),
}
RANGES: dict[tuple[str, str], Range] = {
    key: rule for key, rule in _RULES.items() if isinstance(rule, Range)
}


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    trust_code: bool = True,
) -> Config:
    """Read a TOML (or a run's ``config.json``), apply ``--set`` overrides, validate.
    ``trust_code=False`` (the command's default): a run's ``config.json`` that names a model
    class to import is refused (:func:`require_trust`) unless ``--set model.target`` replaces
    it; a TOML file is the user's own, trusted like a script they run.

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
        if Path(path).suffix == ".json" and not any(
            item.partition("=")[0].strip() == "model.target" for item in overrides
        ):
            require_trust(raw, path, trust_code)
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def require_trust(config: dict[str, Any] | None, source: str | Path, trust_code: bool) -> None:
    """Refuse a file glassloop wrote (a run's config.json, a weights file's description) that
    names code to import (``model.target``), unless the user said they trust it: a run
    directory may have been copied from anywhere, and importing a module runs it."""
    model = (config or {}).get("model")
    target = model.get("target") if isinstance(model, dict) else None
    if target and not trust_code:
        raise ModelError(
            f"model: '{source}' asks to import {target!r} to build its model, and importing "
            "runs code; pass --trust-code (trust_code=True) if you trust this file, or pass "
            "the class yourself (glassloop.load_model(path, model_class=MyNet); train: "
            "--set model.target=...)"
        )


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


# A config file is a few KB; a run directory's config.json is input (copied, shared): one
# larger than this is refused before it is parsed.
MAX_CONFIG_BYTES = 4 << 20


def read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config: file '{path}' not found")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config: '{path}' has {size:,} bytes; a config has at most {MAX_CONFIG_BYTES:,}"
        )
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
            if (section, key) in RANGES and not isinstance(value, str):  # ("auto": its owner's)
                check_range(f"{section}.{key}", value, RANGES[section, key])
        obj = cls(**typed)
        if section in OPEN_SECTIONS:
            obj.kwargs = class_kwargs(section, obj.name, kwargs)
        built[section] = obj
    cfg = Config(**built)
    for section in ("checkpoint", "early_stopping"):
        monitor = getattr(cfg, section).monitor
        if monitor and monitor != "train_loss" and not monitor.startswith("val_"):
            raise ConfigError(
                f"config: {section}.monitor must be 'train_loss' or a validation metric "
                f"('val_loss', 'val_accuracy', 'val_r2', ...), got {monitor!r}"
            )
    if cfg.model.kwargs and not cfg.model.target:  # (it would be ignored)
        keys = ", ".join(f"model.{key}" for key in BUILT_IN_KEYS.get(cfg.model.name, ()))
        raise ConfigError(
            f"config: model.kwargs is for a model.target model only; the built-in "
            f"{cfg.model.name!r} takes {keys} (set those instead), or set model.target = "
            "'package.module:Class'"
        )
    task_fits_loss(cfg, given="name" in raw.get("loss", {}))
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


def class_kwargs(section: str, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``[optim]``'s or ``[scheduler]``'s keyword arguments, checked against the torch class
    ``name`` names (:mod:`glassloop.config.optimizers`). The default class without arguments is
    answered without importing torch (~1.7 s), so ``glassloop config`` starts at once."""
    default = SECTIONS[section]().name
    if name == default and not kwargs:
        return dict(DEFAULT_OPTIM_KWARGS) if section == "optim" else {}
    from glassloop.config.optimizers import optimizer_kwargs, scheduler_kwargs

    check = optimizer_kwargs if section == "optim" else scheduler_kwargs
    return check(name, kwargs)


def task_fits_loss(cfg: Config, *, given: bool) -> None:
    """A ``train.task`` without ``loss.name`` trains with the task's loss (``regression``:
    mse); a loss named for another task is refused (a cross-entropy over a regression's one
    column is 0.0 at every step)."""
    task = cfg.train.task
    if task == "auto":
        return
    if not given:
        cfg.loss.name = TASK_LOSSES[task]
        return
    implied = LOSS_TASKS[cfg.loss.name]
    if not loss_fits(implied, task):
        fitting = [name for name, kind in LOSS_TASKS.items() if loss_fits(kind, task)]
        raise ConfigError(
            f"config: loss.name {cfg.loss.name!r} is a {implied} loss, but train.task is "
            f"{task!r}: drop loss.name (a {task} trains with {TASK_LOSSES[task]!r}) or give "
            f"one of {', '.join(fitting)}"
        )


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
