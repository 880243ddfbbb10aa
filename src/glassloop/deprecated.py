"""Trainer arguments that were replaced while glassloop 0.1 was made, still accepted (with a
``DeprecationWarning``) until 0.2: each folds into the argument that replaced it.

======================  ==================================================
replaced                use instead
======================  ==================================================
``max_nonfinite_skips``  ``nonfinite=NonFinitePolicy("skip", max_skips=N)``
``compile_mode``         ``compile={"mode": ...}``
``compile_dynamic``      ``compile={"dynamic": ...}``
``config``               ``run_info=RunInfo(config=...)``
``model_spec``           ``run_info=RunInfo(model_spec=...)``
======================  ==================================================
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import Any

from glassloop.errors import GlassloopError
from glassloop.options import RunInfo
from glassloop.rules import suggest
from glassloop.step.guards import NonFinitePolicy

REPLACED = {
    "max_nonfinite_skips": "nonfinite=NonFinitePolicy(policy, max_skips=N)",
    "compile_mode": "compile={'mode': ...}",
    "compile_dynamic": "compile={'dynamic': ...}",
    "config": "run_info=RunInfo(config=...)",
    "model_spec": "run_info=RunInfo(model_spec=...)",
}
COMPILE_KEYS = ("mode", "dynamic")
# What other libraries' trainers take and glassloop takes elsewhere (Lightning's max_epochs,
# Keras' epochs, a learning rate): suggested where a typo's nearest argument would be.
ELSEWHERE = {"epochs": "fit(loader, epochs=...)", "lr": "the optimizer's: AdamW(params, lr=...)"}


def fold_replaced(
    replaced: dict[str, Any],
    nonfinite: str | NonFinitePolicy,
    compile: bool | Mapping[str, Any],
    run_info: RunInfo | None,
    known: Collection[str] = (),
) -> tuple[NonFinitePolicy, dict[str, Any] | None, RunInfo]:
    """``nonfinite`` as a policy, ``compile`` as ``torch.compile``'s options (``None``: not
    compiled) and the run's info, with the replaced names in ``replaced`` folded in (each
    with a warning); an unknown name is a ``TypeError``, as Python's own would be, with the
    argument of ``known`` (the Trainer's) it most likely means, as a config's typo gets.

    >>> fold_replaced({"log_evry": 10}, "raise", False, None, ["log_every"])
    Traceback (most recent call last):
    ...
    TypeError: Trainer() got an unexpected keyword argument 'log_evry' (did you mean 'log_every'?)
    """
    for name in replaced:
        if name not in REPLACED:
            guess = suggest(
                name, [*(k for k in known if k not in ("self", "replaced")), *ELSEWHERE]
            )
            hint = f" (did you mean {ELSEWHERE.get(guess, repr(guess))}?)" if guess else ""
            raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}{hint}")
        old = f"Trainer({name}=...) is replaced by {REPLACED[name]}"
        warnings.warn(
            f"{old}; the old name goes in glassloop 0.2", DeprecationWarning, stacklevel=3
        )
    if isinstance(nonfinite, str):
        nonfinite = NonFinitePolicy(nonfinite, replaced.get("max_nonfinite_skips", 10))
    options: dict[str, Any] | None = None
    if isinstance(compile, Mapping):
        unknown = sorted(set(compile) - set(COMPILE_KEYS))
        if unknown:
            raise GlassloopError(f"Trainer: compile takes {COMPILE_KEYS}, got {unknown}")
        options = {"mode": "default", "dynamic": False, **compile}
    elif compile:
        options = {"mode": "default", "dynamic": False}
    if options is not None:
        for key in COMPILE_KEYS:
            if f"compile_{key}" in replaced:
                options[key] = replaced[f"compile_{key}"]
    info = run_info if run_info is not None else RunInfo()
    config, spec = replaced.get("config", info.config), replaced.get("model_spec", info.model_spec)
    if replaced.keys() & {"config", "model_spec"}:
        info = RunInfo(config, spec)
    return nonfinite, options, info


def warn_replaced(old: str, new: str) -> None:
    """A name replaced while 0.1 was made (the one Trainer and its Checkpointer): it works,
    with a ``DeprecationWarning`` naming its replacement, until 0.2."""
    message = f"{old} is replaced by {new}; the old name goes in glassloop 0.2"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
