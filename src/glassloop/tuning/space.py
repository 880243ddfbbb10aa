"""SPACE.toml, read and checked before any trial starts: the metric and its direction, the
pruner, and for each config key its range or its choices. Every value a trial can take is
checked as a ``--set`` override of the sweep's config (:func:`glassloop.load_config`), so a
bad key, range end or choice is the config's own one-line error ("did you mean ...").

::

    metric = "val_loss"      # default: checkpoint.monitor, else val_loss
    direction = "minimize"   # default: as checkpoint.mode says (max for accuracy, F1, ...)
    pruner = "median"        # "none" | "median" | "hyperband" | "asha", or a table:
                             # { name = "median", n_startup_trials = 1 } (the class's options)
    [space]
    "optim.lr" = { low = 1e-4, high = 3e-1, log = true }   # also: step = ...
    "model.hidden" = { choices = [[16], [32], [64, 64]] }
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from glassloop.best import monitor_mode
from glassloop.config.schema import load_config, read_file, to_dict
from glassloop.errors import ConfigError, GlassloopError
from glassloop.rules import suggest

if TYPE_CHECKING:
    import optuna

TOP_KEYS = ("metric", "direction", "pruner", "space")
# Each pruner's class in optuna.pruners, and in ray.tune.schedulers (--backend ray).
PRUNERS = {
    "none": ("NopPruner", "FIFOScheduler"),
    "median": ("MedianPruner", "MedianStoppingRule"),
    "hyperband": ("HyperbandPruner", "AsyncHyperBandScheduler"),
    "asha": ("SuccessiveHalvingPruner", "ASHAScheduler"),
}


def require(name: str, extra: str) -> Any:
    """``optuna`` or ``ray.tune``, imported only when a sweep starts (``glassloop --help``
    never imports them), or one line naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise GlassloopError(
            f"tune: {name} is not installed; install it with pip install 'glassloop[{extra}]'"
        ) from None


@dataclass(frozen=True)
class Param:
    """One key of ``[space]``: a range (``low``/``high``, ``log``, ``step``) or ``choices``."""

    key: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    whole: bool = False  # a range of whole numbers (suggest_int)
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: optuna.Trial) -> Any:
        """This key's value for ``trial``; a choice is suggested as its JSON text, which
        optuna stores as it is (a list such as ``[64, 64]`` is no optuna choice)."""
        if self.choices:
            options = [json.dumps(c) for c in self.choices]
            return json.loads(trial.suggest_categorical(self.key, options))
        assert self.low is not None and self.high is not None
        if self.whole:
            step = int(self.step or 1)
            return trial.suggest_int(
                self.key, int(self.low), int(self.high), step=step, log=self.log
            )
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)


@dataclass(frozen=True)
class Space:
    """SPACE.toml, checked: what :func:`glassloop.tuning.sweep.tune` searches."""

    metric: str
    direction: str  # "minimize" or "maximize"
    pruner: Any  # an optuna pruner, or Ray's scheduler for --backend ray
    params: tuple[Param, ...]
    seed: int  # the config's train.seed: the sampler's, so a sweep's draws repeat

    def overrides(self, trial: optuna.Trial) -> list[str]:
        """The trial's values as ``--set`` items (``optim.lr=0.0123``)."""
        return [f"{p.key}={json.dumps(p.suggest(trial))}" for p in self.params]

    def suggest_all(self, trial: optuna.Trial) -> None:
        """Draw every key's value for ``trial`` (Ray's OptunaSearch reads them from it)."""
        for param in self.params:
            param.suggest(trial)


def read_space(
    path: str | Path,
    config: str | Path | None,
    overrides: Sequence[str] = (),
    backend: str = "optuna",
) -> Space:
    """Read and check ``path`` against the config (``config`` with ``overrides``); every
    mistake is a :class:`~glassloop.errors.ConfigError` of one line. ``backend="ray"``: the
    pruner is Ray Tune's scheduler on the epoch.

    >>> import tempfile, pathlib
    >>> file = pathlib.Path(tempfile.mkdtemp()) / "s.toml"
    >>> _ = file.write_text('[space]\\n"optim.lrr" = { low = 1, high = 2 }')
    >>> try:
    ...     read_space(file, None)
    ... except ConfigError as err:
    ...     print(err)
    s.toml: [space] 'optim.lrr' low = 1: config: unknown key 'optim.lrr' (did you mean 'optim.lr'?)
    """
    optuna = require("optuna", "search")
    name = Path(path).name
    raw = read_file(Path(path))  # (a config file's limits: size, UTF-8, nesting)
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(f"{name}: unknown key {key!r}{_did_you_mean(key, TOP_KEYS)}")
    cfg = load_config(config, list(overrides))
    metric = str(raw.get("metric") or cfg.checkpoint.monitor or "val_loss")
    try:  # (the config's own rule for a monitored metric: train_loss or val_*)
        load_config(config, [*overrides, f"checkpoint.monitor={json.dumps(metric)}"])
    except ConfigError as err:
        raise ConfigError(f"{name}: metric = {metric!r}: {err}") from None
    mode = cfg.checkpoint.mode if metric == cfg.checkpoint.monitor else "auto"
    direction = raw.get(
        "direction", "maximize" if monitor_mode(metric, mode) == "max" else "minimize"
    )
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"{name}: direction must be 'minimize' or 'maximize', got {direction!r}")
    table = raw.get("space")
    if not isinstance(table, dict) or not table:
        raise ConfigError(
            f'{name}: no [space] table; add one, e.g. "optim.lr" = {{ low = 1e-4, high = 1e-1 }}'
        )
    current = to_dict(cfg)
    params = tuple(
        _param(name, key, spec, config, overrides, current) for key, spec in table.items()
    )
    mode = "min" if direction == "minimize" else "max"
    ray = {"time_attr": "epoch", "metric": metric, "mode": mode}
    # Ray's on the epoch, the config's epochs the longest a trial trains; one that gets there
    # is not stopped (stop_last_trials) but ends its run: its final save and run.json.
    last = {"max_t": cfg.train.epochs, "stop_last_trials": False}
    defaults = {
        "none": {},
        "median": {**ray, "grace_period": 1},
        "hyperband": {**ray, **last, "brackets": 3},
        "asha": {**ray, **last},
    }
    ray_backend = backend == "ray"
    home = require("ray.tune.schedulers", "ray") if ray_backend else optuna.pruners
    spec = raw.get("pruner", "none")
    pruner = _pruner(name, spec, home, int(ray_backend), defaults if ray_backend else {})
    return Space(metric, direction, pruner, params, cfg.train.seed)


def _param(
    name: str,
    key: str,
    spec: Any,
    config: str | Path | None,
    overrides: Sequence[str],
    current: dict[str, Any],
) -> Param:
    """One ``[space]`` entry, each value it can take loaded as an override of the config."""
    shape = "{ low = ..., high = ... [, log = true] [, step = ...] } or { choices = [...] }"
    if not isinstance(spec, dict) or not (
        set(spec) == {"choices"} or {"low", "high"} <= set(spec) <= {"low", "high", "log", "step"}
    ):
        raise ConfigError(f"{name}: [space] {key!r} must be {shape}, got {spec!r}")
    if "choices" in spec:
        values = spec["choices"]
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{name}: [space] {key!r} choices must be a non-empty list, got {values!r}"
            )
        tried = [(f"choice {json.dumps(v)}", v) for v in values]
    else:
        low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
        numbers = [v for v in (low, high, step) if v is not None]
        if any(
            isinstance(v, bool) or not isinstance(v, int | float) for v in numbers
        ) or not isinstance(log, bool):
            raise ConfigError(
                f"{name}: [space] {key!r}: low, high, step: numbers; log: true or false; got {spec}"
            )
        if not low < high:
            raise ConfigError(f"{name}: [space] {key!r}: low must be below high, got {spec}")
        tried = [(f"low = {low}", low), (f"high = {high}", high)]
    for what, value in tried:  # (every check of the config applies: names, types, ranges)
        try:
            load_config(config, [*overrides, f"{key}={json.dumps(value)}"])
        except ConfigError as err:
            raise ConfigError(f"{name}: [space] {key!r} {what}: {err}") from None
    if "choices" in spec:
        return Param(key, choices=tuple(spec["choices"]))
    section, _, leaf = key.partition(".")
    whole = all(isinstance(v, int) for v in numbers) and not isinstance(
        current.get(section, {}).get(leaf), float
    )
    kinds = require("optuna", "search").distributions
    try:  # (optuna's own rules: low > 0 on a log scale; a step > 0, not with log)
        if whole:
            kinds.IntDistribution(low, high, log=log, step=1 if step is None else step)
        else:
            kinds.FloatDistribution(low, high, log=log, step=step)
    except ValueError as err:
        raise ConfigError(f"{name}: [space] {key!r}: {err}") from None
    return Param(key, float(low), float(high), log, None if step is None else float(step), whole)


def _pruner(
    name: str, spec: Any, home: ModuleType, which: int, defaults: dict[str, dict[str, Any]]
) -> Any:
    """``"median"`` or ``{ name = "median", n_startup_trials = 1 }``: the pruner's class in
    ``home`` (``PRUNERS[kind][which]``) made with ``defaults[kind]`` and the options, each
    checked by name against its signature."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    kind = options.pop("name", None)
    if kind not in PRUNERS:
        raise ConfigError(
            f"{name}: pruner must be one of {', '.join(map(repr, PRUNERS))}, got {kind!r}"
        )
    cls = getattr(home, PRUNERS[kind][which])
    options = {**defaults.get(kind, {}), **options}
    known = list(inspect.signature(cls).parameters)
    for option in options:
        if option not in known:
            raise ConfigError(
                f"{name}: pruner {kind!r} has no option {option!r}{_did_you_mean(option, known)}"
            )
    try:
        return cls(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{name}: pruner {kind!r}: {err}") from None


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    guess = suggest(word, list(known))
    return f" (did you mean {guess!r}?)" if guess else f" (known: {', '.join(known)})"
