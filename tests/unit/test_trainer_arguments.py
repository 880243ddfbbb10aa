"""The Trainer's arguments: each one described in its docstring, the config's keys passed to
it without drift, and the names replaced in 0.2 still working (with a warning)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn

from glassloop import Trainer
from glassloop.arguments import ARGUMENTS as TABLE
from glassloop.assemble import trainer_options
from glassloop.config import Config, TrainConfig
from glassloop.guards import NonFinitePolicy
from glassloop.run_log import RunInfo

ARGUMENTS = [
    name
    for name, p in inspect.signature(Trainer.__init__).parameters.items()
    if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
]
# [train] keys that are not Trainer arguments of the same name, and where they go instead.
NOT_ARGUMENTS = {
    "epochs": "fit(epochs=)", "seed": "seeded before the model is built", "device": "build()",
    "task": "build() (resolved with the loss)", "dist_timeout_s": "the process group",
    "max_nonfinite_skips": "nonfinite's NonFinitePolicy", "compile_mode": "compile's mapping",
    "compile_dynamic": "compile's mapping",
}  # fmt: skip


def test_every_argument_is_described_in_the_docstring() -> None:
    """help(Trainer) is enough to use it: each argument is named (``name``) in the class
    docstring."""
    doc = Trainer.__doc__ or ""
    assert [name for name in ARGUMENTS if f"``{name}``" not in doc] == []
    # (the lines come from glassloop.arguments' table: one per argument, none left over)
    table = [name for group in TABLE.values() for name in group]
    assert sorted(table) == sorted(ARGUMENTS)


def test_the_config_passes_every_train_key_that_is_an_argument() -> None:
    """trainer_options(cfg) and the Trainer's signature agree: a [train] key added to one
    and not the other fails here."""
    options = trainer_options(Config())
    assert set(options) <= set(ARGUMENTS), set(options) - set(ARGUMENTS)
    for field in dataclasses.fields(TrainConfig):
        if field.name in NOT_ARGUMENTS:
            assert field.name not in options
        else:
            assert field.name in options, f"[train] {field.name} does not reach the Trainer"


def make(**kwargs: object) -> Trainer:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none", **kwargs)  # type: ignore[arg-type]


def test_replaced_names_still_work_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="max_nonfinite_skips=.* is replaced by"):
        old = make(nonfinite="skip", max_nonfinite_skips=3)
    assert (old.nonfinite.policy, old.nonfinite.max_skips) == ("skip", 3)
    with pytest.warns(DeprecationWarning, match="run_info=RunInfo"):
        spec = make(config={"a": 1}, model_spec={"b": 2})
    assert (spec.config, spec.model_spec) == ({"a": 1}, {"b": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn about nothing
        new = make(
            nonfinite=NonFinitePolicy("skip", max_skips=3), run_info=RunInfo({"a": 1}, {"b": 2})
        )
    assert (new.nonfinite.max_skips, new.config, new.model_spec) == (3, {"a": 1}, {"b": 2})


def test_an_unknown_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_skips'"):
        make(max_skips=3)
    with pytest.raises(Exception, match="compile takes"):
        make(compile={"fullgraph": True})
