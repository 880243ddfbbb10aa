"""The Trainer's arguments and the one table of its options (glassloop.options): every keyword
described, the signature and the table agreeing, the config's [train] keys passed without
drift, every option compared on the resume of a run built in Python, and the names replaced
in 0.2 still working (with a warning)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import textwrap
import warnings
from pathlib import Path

import forkserver
import pytest
import torch
from torch import nn

from glassloop import Trainer
from glassloop.config.assemble import BUILT_HERE, trainer_options
from glassloop.config.schema import Config, TrainConfig
from glassloop.errors import GlassloopError
from glassloop.options import ARGUMENTS, RunInfo, TrainOptions, docs, resume_safe
from glassloop.step.guards import NonFinitePolicy
from glassloop.tracking.run_log import python_config

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_trainer_arguments")

SIGNATURE = {
    name: p
    for name, p in inspect.signature(Trainer.__init__).parameters.items()
    if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
}
OPTIONS = {f.name: f for f in dataclasses.fields(TrainOptions)}
# [train] keys that are not Trainer arguments of the same name, and where they go instead.
NOT_ARGUMENTS = {
    "epochs": "fit(epochs=)",
    "dist_timeout_s": "the process group",
    "max_nonfinite_skips": "nonfinite's NonFinitePolicy",
    "compile_mode": "compile's mapping",
    "compile_dynamic": "compile's mapping",
}


def test_every_argument_is_an_option_of_the_table_or_an_object_described_beside_it() -> None:
    """A keyword is either a field of TrainOptions (its description under it, in the source
    where editors show it) or one of the objects glassloop.options.ARGUMENTS describes; help
    (Trainer) shows every one of them."""
    assert set(SIGNATURE) == set(OPTIONS) | set(ARGUMENTS), set(SIGNATURE) ^ (
        set(OPTIONS) | set(ARGUMENTS)
    )
    assert not set(OPTIONS) & set(ARGUMENTS)
    described = docs()
    assert [name for name in OPTIONS if not described.get(name)] == []
    doc = Trainer.__doc__ or ""
    assert [name for name in SIGNATURE if f"``{name}``" not in doc] == []


def test_the_signature_and_the_table_agree_on_every_default() -> None:
    """Python's ``None``/``()`` stand for the table's off value (0, an empty list); the one
    difference in meaning is ``seed``: the Trainer seeds only when given one."""
    for name, field in OPTIONS.items():
        table = (
            field.default
            if field.default_factory is dataclasses.MISSING
            else field.default_factory()
        )  # type: ignore[misc]
        default = SIGNATURE[name].default
        if default is None or default == ():
            assert not table or name == "seed", name
        else:
            assert default == table or list(default) == table, (name, default, table)


def test_the_config_passes_every_option_and_reads_it_from_the_table() -> None:
    """[train] is the table plus the keys build() reads itself; trainer_options(cfg) hands
    the Trainer every option but those build() passes itself."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert names == set(OPTIONS) | set(NOT_ARGUMENTS)
    options = trainer_options(Config())
    assert set(options) <= set(SIGNATURE), set(options) - set(SIGNATURE)
    assert set(OPTIONS) - BUILT_HERE <= set(options)
    assert not set(NOT_ARGUMENTS) & set(options)


def test_a_new_option_is_checked_and_recorded_from_the_table_alone() -> None:
    """stop_signals was added in two places (the table and the signature): the Trainer checks
    it, a config checks it, and a run built in Python records it."""
    from glassloop.config.schema import from_dict
    from glassloop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^Trainer: stop_signals\[1\] must be one of TERM, INT"):
        make(stop_signals=["TERM", "KILL"])
    with pytest.raises(ConfigError, match=r"^config: train.stop_signals\[0\] must be one of"):
        from_dict({"train": {"stop_signals": ["STOP"]}})
    assert from_dict({"train": {"stop_signals": ["USR1"]}}).train.stop_signals == ["USR1"]
    recorded = python_config(make(stop_signals=["USR1"]))
    assert recorded["stop_signals"] == ["USR1"]
    assert set(OPTIONS) <= set(recorded)
    assert "stop_signals" in resume_safe(TrainOptions)


def make(**kwargs: object) -> Trainer:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none", **kwargs)  # type: ignore[arg-type]


# A run built in Python, trained one epoch; then, in one new process, a copy of it resumed
# with each option changed in turn: a config run compares these keys, and a run built in
# Python does too. The script prints each attempt's outcome as a JSON line.
SCRIPT = textwrap.dedent(
    """
    import json, shutil, sys
    import torch
    from torch import nn
    from glassloop import Trainer, GlassloopError
    first, attempts, epochs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    for name, options in attempts.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        data = torch.utils.data.TensorDataset(x, y)
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        run = first if name == "" else shutil.copytree(first, f"{first}-{name}")
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.CrossEntropyLoss(), device="cpu", progress="none", run_dir=run,
                          **options)
        try:
            trainer.fit(loader, loader, epochs=epochs, resume="auto")
            print(json.dumps({"name": name, "error": None}))
        except GlassloopError as err:
            print(json.dumps({"name": name, "error": str(err)}))
    """
)

CHANGED = {
    "ignore_index": 3,
    "nonfinite": "skip",
    "validate_every_n_steps": 2,
    "seed": 7,
    "deterministic": "warn",
    "metrics": ["top2_accuracy"],
    "loss_spike": 10.0,
    "activation_checkpointing": ["Linear"],
    "strategy": "ddp",
}


def attempt(
    first: Path, attempts: dict[str, dict[str, object]], epochs: int
) -> dict[str, str | None]:
    script = first.parent / "attempts.py"  # (run in a new process, forked: tests/forkserver.py)
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), str(first), json.dumps(attempts), str(epochs)]
    done = forkserver.run(command, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["name"]: row["error"] for row in rows}


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("python-run") / "run"
    assert attempt(run, {"": {}}, 1) == {"": None}
    return run


def test_a_python_run_compares_every_option_on_resume(first_epoch: Path) -> None:
    """The nine options a run built in Python used to leave out of its resume check: each
    changed alone refuses the resume, naming it; resume-safe ones resume."""
    changed = {name: {name: value} for name, value in CHANGED.items()}
    safe = {"log_every": 1, "stop_signals": ["TERM", "INT", "USR1"]}
    errors = attempt(first_epoch, {**changed, "safe": safe}, 2)
    for name in CHANGED:
        error = errors[name] or ""
        assert "was made with a different config" in error and f"{name}: " in error, error
    assert errors["safe"] is None
    run = first_epoch.parent / f"{first_epoch.name}-safe"
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


def test_replaced_names_still_work_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="max_nonfinite_skips=.* is replaced by"):
        old = make(nonfinite="skip", max_nonfinite_skips=3)
    assert (old.nonfinite.policy, old.nonfinite.max_skips) == ("skip", 3)
    with pytest.warns(DeprecationWarning, match="run_info=RunInfo"):
        spec = make(config={"a": 1}, model_spec={"b": 2})
    assert (spec.config, spec.info.model_spec) == ({"a": 1}, {"b": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn about nothing
        new = make(
            nonfinite=NonFinitePolicy("skip", max_skips=3), run_info=RunInfo({"a": 1}, {"b": 2})
        )
    assert (new.nonfinite.max_skips, new.config, new.info.model_spec) == (3, {"a": 1}, {"b": 2})


def test_an_unknown_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_skips'"):
        make(max_skips=3)
    with pytest.raises(Exception, match="compile takes"):
        make(compile={"fullgraph": True})
    # A typo gets what a config's gets: the argument it most likely means (any of them).
    for typo, meant in (("log_evry", "log_every"), ("callback", "callbacks"), ("qqq", None)):
        with pytest.raises(TypeError) as err:
            make(**{typo: 1})
        hint = f" (did you mean '{meant}'?)" if meant else ""
        assert str(err.value) == f"Trainer() got an unexpected keyword argument '{typo}'{hint}"
    # What a Lightning or Keras user types first: where glassloop takes it (a bare TypeError).
    for name in ("epochs", "max_epochs", "num_epochs"):
        with pytest.raises(TypeError, match=rf"'{name}' \(did you mean fit\(loader, epochs="):
            make(**{name: 3})
    for name in ("lr", "learning_rate"):
        with pytest.raises(TypeError, match=rf"'{name}' \(did you mean the optimizer's: AdamW"):
            make(**{name: 0.1})


def test_save_checkpoint_still_works_with_a_warning_and_state_loads_back(tmp_path: Path) -> None:
    """Trainer.save_checkpoint() (0.2) saves through the checkpointer, with a warning;
    load_state_dict() restores what state_dict() gave, the loop's position included."""
    trainer = make(run_dir=tmp_path / "run")
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer.fit(loader, epochs=1)
    saved = trainer.state_dict()
    with pytest.warns(DeprecationWarning, match=r"save_checkpoint\(\) is replaced by"):
        path = trainer.save_checkpoint()
    assert path is not None and (path / "manifest.json").is_file()
    again = make()
    again.load_state_dict(saved)
    assert (again.state.step, again.state.epoch) == (4, 1)
    assert again.history == trainer.history


def test_a_stateful_part_without_state_dict_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """The checkpointer is handed the parts once per fit and refuses one it could not save
    then, not at the first checkpoint (accelerate's register_for_checkpointing does the same)."""

    class Carrying(Trainer):
        def stateful(self) -> dict[str, object]:
            return {**super().stateful(), "carry": [0.0]}

    model = nn.Linear(3, 2)
    trainer = Carrying(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        run_dir=tmp_path / "run",
    )
    loader = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))]
    with pytest.raises(GlassloopError, match=r"stateful\(\)\['carry'\] is a list, which has no"):
        trainer.fit(loader, epochs=1)
    assert not (tmp_path / "run").exists()


def test_the_resume_rules_derived_from_the_tables_are_the_ones_of_before() -> None:
    """What a resume may change is now read from the tables (options, [data]); the keys that
    were safe stay safe, and one that was compared stays compared."""
    from glassloop.checkpoint.resume import RESUME_SAFE_KEYS, config_differences

    before = (
        "train.epochs",
        "train.log_every",
        "train.progress",
        "train.device",
        "data.num_workers",
        "data.eval_batch_size",
        "train.compile",
        "train.compile_mode",
        "train.compile_dynamic",
        "compile",
        "device",
    )
    assert set(before) <= set(RESUME_SAFE_KEYS)
    saved = {"data": {"num_workers": 0, "eval_batch_size": 0}, "train": {"tensorboard": False}}
    now = {"data": {"num_workers": 4, "eval_batch_size": 512}, "train": {"tensorboard": True}}
    assert config_differences(saved, now) == ["train.tensorboard: False -> True"]
