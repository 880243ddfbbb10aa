"""train.deterministic: torch's deterministic algorithms (and cuDNN's, cuBLAS's workspace),
switched on by the Trainer, recorded in run.json, one line for a value it does not take."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from glassloop import ConfigError, Trainer
from glassloop.config.schema import from_dict


@pytest.fixture(autouse=True)
def restore_torch_settings() -> Iterator[None]:
    """The settings are process-wide: put them back for the other tests."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )  # fmt: skip
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    if before[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def make(tmp_path: Path, mode: bool | str) -> Trainer:
    model = nn.Linear(3, 2)
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=tmp_path / "run", deterministic=mode,
    )  # fmt: skip


@pytest.mark.parametrize(("mode", "recorded"), [(True, "on"), ("warn", "warn"), (False, "off")])
def test_deterministic_mode_is_set_and_recorded(
    tmp_path: Path, mode: bool | str, recorded: str
) -> None:
    torch.use_deterministic_algorithms(False)
    trainer = make(tmp_path, mode)
    assert torch.are_deterministic_algorithms_enabled() is (mode is not False)
    assert torch.is_deterministic_algorithms_warn_only_enabled() is (mode == "warn")
    if mode is not False:
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    trainer.fit([(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))], epochs=1)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["deterministic"] == recorded


def test_the_config_key_reaches_the_trainer_and_a_wrong_value_is_one_line() -> None:
    assert from_dict({"train": {"deterministic": "warn"}}).train.deterministic == "warn"
    with pytest.raises(ConfigError, match=r"train\.deterministic"):
        from_dict({"train": {"deterministic": "always"}})
    with pytest.raises(
        ConfigError, match=r"^Trainer: deterministic must be one of False, True, warn"
    ):
        make(Path("/nonexistent"), "always")


def test_a_cold_cache_leaves_the_global_rngs_as_a_warm_one(tmp_path: Path) -> None:
    """Building a cached split imports scikit-learn, which imports rich, which draws from
    Python's RNG: a run on a fresh cache ended with another RNG state than its resume on
    the warm one (verify-resume: rng DIFFERENT). In a fresh interpreter (where nothing is
    imported yet), cold then warm: the global RNGs come out as they went in."""
    import subprocess
    import sys

    code = (
        "import numpy as np, random, torch\n"
        "from glassloop.config.schema import DataConfig\n"
        "from glassloop.data import load_splits\n"
        "from glassloop.rng import seed_everything\n"
        "for _ in ('cold', 'warm'):\n"
        "    seed_everything(3)\n"
        "    load_splits(DataConfig(name='digits', seed=11))\n"
        "    print(random.random(), np.random.rand(), torch.rand(1).item())\n"
    )
    env = {**os.environ, "GLASSLOOP_CACHE_DIR": str(tmp_path / "cold")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cold, warm = done.stdout.splitlines()
    assert cold == warm
