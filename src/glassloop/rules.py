"""Rules for one value of a config or an option: its type, its range, and a suggestion for
a mistyped name. Shared by the option tables, the config reader and the optimizer lookup."""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from glassloop.errors import ConfigError

# Names people type for our keys; difflib cannot guess these from spelling alone.
ALIASES = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "optimizer": "optim",
    "optimiser": "optim",
    "lr_scheduler": "scheduler",
    "schedule": "scheduler",
    "num_epochs": "epochs",
    "epoch": "epochs",
    "n_epochs": "epochs",
    "batchsize": "batch_size",
    "bs": "batch_size",
    "wd": "weight_decay",
    "hidden_sizes": "hidden",
    "hidden_size": "hidden",
    "workers": "num_workers",
    "dataset": "data",
}


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``low``/``high`` (``None``: unbounded), each
    inclusive unless ``open_low``/``open_high``."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.open_low else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return low_ok and high_ok

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {_shown(self.low)}"
        low = "(" if self.open_low else "["
        high = ")" if self.open_high else "]"
        return f"in {low}{_shown(self.low)}, {_shown(self.high)}{high}"


def _shown(value: float | None) -> str:
    """A bound as a user reads it: whole numbers in full (2147483648, not 2.14748e+09)."""
    if isinstance(value, int):  # (exact: 2**63 - 1 is no float)
        return str(value)
    number = float(value or 0)
    return str(int(number)) if number.is_integer() else f"{number:g}"


AT_LEAST_0, AT_LEAST_1 = Range(0), Range(1)
FRACTION = Range(0.0, 1.0, open_high=True)


@dataclass(frozen=True)
class OffOr(Range):
    """0 (off), or a value in the range (``loss_spike``: at 1 or below, any loss above the
    recent median would stop a run, a falling one included)."""

    def __contains__(self, value: float) -> bool:
        return value == 0 or super().__contains__(value)

    def __str__(self) -> str:
        return f"0 (off) or {'over' if self.open_low else 'at least'} {_shown(self.low)}"


def check_range(key: str, value: Any, accepted: Range, *, where: str = "config") -> None:
    """Raise ConfigError unless ``value`` (or each item of a list) is in ``accepted``."""
    for i, item in enumerate(value if isinstance(value, list) else [value]):
        if item not in accepted:
            name = f"{key}[{i}]" if isinstance(value, list) else key
            raise ConfigError(f"{where}: {name} must be {accepted}, got {item!r}")


def check_choice(key: str, value: Any, choices: tuple[Any, ...], *, where: str = "config") -> None:
    """Raise ConfigError unless ``value`` (or each item of a list) is one of ``choices``."""
    for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
        if item not in choices:
            name = f"{key}[{i}]" if isinstance(value, (list, tuple)) else key
            raise ConfigError(
                f"{where}: {name} must be one of {', '.join(map(str, choices))}; got {item!r}"
            )


# What one value of a config may hold, checked before any work: a config is input (a run
# directory's config.json is copied and shared), and 5,000,001 entries in model.hidden built
# that many layers (~30 min) for eval, report and --resume. A list or a table holds at most
# MAX_ITEMS items (in all, nested), a string at most MAX_TEXT characters.
MAX_ITEMS = 10_000
MAX_TEXT = 10_000


def check_size(key: str, value: Any, *, where: str = "config") -> None:
    """Raise ConfigError if ``value`` (a list, a table, nested) holds more than
    :data:`MAX_ITEMS` items in all or a string longer than :data:`MAX_TEXT`.

    >>> try:
    ...     check_size("model.hidden", [4] * 10_001)
    ... except ConfigError as err:
    ...     print(err)
    config: model.hidden holds more than 10,000 items; a config value holds at most 10,000
    """
    stack, items = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str) and len(item) > MAX_TEXT:
            raise ConfigError(
                f"{where}: {key} holds a string of {len(item):,} characters; a config value "
                f"holds at most {MAX_TEXT:,}"
            )
        if isinstance(item, (list, dict)):
            items += len(item)
            if items > MAX_ITEMS:
                raise ConfigError(
                    f"{where}: {key} holds more than {MAX_ITEMS:,} items; a config value "
                    f"holds at most {MAX_ITEMS:,}"
                )
            stack.extend(item.values() if isinstance(item, dict) else item)
            if isinstance(item, dict):
                stack.extend(item)


def check_type(key: str, value: Any, hint: Any) -> Any:
    """Return ``value`` (ints widened to float) if it fits ``hint``, else raise ConfigError
    (a value larger than :func:`check_size` allows too)."""
    check_size(key, value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        for option in options:
            try:
                return check_type(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"config: {key} has the wrong type: got {value!r}")
    if hint is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif hint is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        if ok and not -(2**63) <= value < 2**63:  # torch and numpy take 64-bit integers
            ok, want = False, "an integer that fits in 64 bits"
    elif hint is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        if ok and not math.isfinite(value):  # nan/inf: never what a user meant
            ok, want = False, "a finite number"
        value = float(value) if ok else value
    elif hint is str:
        ok, want = isinstance(value, str), "a string"
    elif origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        return [check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    elif origin is dict:
        ok, want = isinstance(value, dict), "a table"
    else:  # pragma: no cover - only the hints above are used
        raise AssertionError(f"unsupported config type {hint!r}")
    if not ok:
        raise ConfigError(f"config: {key} must be {want}, got {value!r}")
    return value


def suggest(name: str, candidates: list[str]) -> str | None:
    """The candidate a user most likely meant (alias, case, spelling, prefix), or ``None``.

    >>> suggest("learning_rate", ["lr", "name"]), suggest("adamw", ["Adam", "AdamW"])
    ('lr', 'AdamW')
    """
    alias = ALIASES.get(name.lower())
    if alias in candidates:
        return alias
    lower = {c.lower(): c for c in candidates}
    if name.lower() in lower:
        return lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    if close:
        return lower[close[0]]
    starts = [c for c in candidates if c.lower().startswith(name.lower())]
    return starts[0] if len(name) >= 3 and len(starts) == 1 else None


def unknown_key(prefix: str, name: str, candidates: list[str], owner: str = "") -> ConfigError:
    full = f"{prefix}.{name}" if prefix else name
    guess = suggest(name, candidates)
    if guess:
        hint = f" (did you mean '{prefix + '.' if prefix else ''}{guess}'?)"
    else:
        what = f"{owner} accepts" if owner else "known keys"
        hint = f" ({what}: {', '.join(sorted(candidates))})"
    return ConfigError(f"config: unknown key '{full}'{hint}")


def loss_fits(implied: str, task: str) -> bool:
    """Whether a loss that implies the task ``implied`` can train ``task`` (a language
    model's loss is a classification's, per token; ``custom`` takes any loss).

    >>> loss_fits("classification", "language-model"), loss_fits("classification", "regression")
    (True, False)
    """
    same_kind = implied == "classification" and task == "language-model"
    return implied == task or same_kind or task == "custom"
