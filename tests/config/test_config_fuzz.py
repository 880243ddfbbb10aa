"""Every config key, given every kind of wrong value (wrong types, NaN, +-inf, integers past
int64, negative numbers, empty and wrong-length lists, unicode, tables): glassloop either
accepts it and runs, or refuses it with one line and exit code 2, never a traceback. The
values that the config accepts are then run through a quick training (``--fast-dev-run``):
errors that only the model, the optimizer or the data can find are one line too."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from cli_runner import run_glassloop, sets

from glassloop.config.schema import SECTIONS

BASE = ["data.name=synthetic", "data.num_samples=64", "data.num_features=4",
        "model.hidden=[4]", "train.epochs=1", "train.progress=none"]  # fmt: skip
HOSTILE = ['"x"', "nan", "inf", "-inf", "-1", "0", "99999999999999999999", "[]", "[1, 2, 3]",
           '"ünïcödé ✓"', "{ a = 1 }", "1.5", "[nan]"]  # fmt: skip
# Keyword arguments of the default optimizer and scheduler are keys too.
OPEN_KEYS = ["optim.betas", "optim.eps", "optim.weight_decay", "optim.amsgrad", "scheduler.T_max",
             "scheduler.eta_min"]  # fmt: skip
# Keys whose accepted values start work that is not what this test is about (an import, a
# compile, a tracker): their malformed values are covered; these valid-looking ones are not.
SLOW_IF_ACCEPTED = {"model.target", "train.compile", "tracking.backend"}
KEYS = [
    f"{section}.{field.name}"
    for section, cls in SECTIONS.items()
    for field in dataclasses.fields(cls)
    if field.name != "kwargs"
] + OPEN_KEYS


def assert_clean(done: object, what: str) -> None:
    code, err = done.returncode, done.stderr  # type: ignore[attr-defined]
    # 0: accepted and ran; 2: refused; 4: accepted, and training diverged (an lr of 1e20)
    assert code in (0, 2, 4), f"{what}: exit {code}\n{err[-2000:]}"
    assert "Traceback" not in err, f"{what}: {err[-2000:]}"
    if code != 0:
        assert len(err.strip().splitlines()) == 1, f"{what}: {err}"


def test_every_key_with_every_wrong_value_is_one_line_or_runs(tmp_path: Path) -> None:
    accepted: list[tuple[str, str]] = []
    for key, value in itertools.product(KEYS, HOSTILE):
        done = run_glassloop("config", *sets([*BASE, f"{key}={value}"]))
        assert_clean(done, f"config --set {key}={value}")
        if done.returncode == 0 and key not in SLOW_IF_ACCEPTED:
            accepted.append((key, value))
    assert len(accepted) < len(KEYS) * len(HOSTILE) / 2  # most are refused at once
    for n, (key, value) in enumerate(accepted):
        done = run_glassloop(
            "train", *sets([*BASE, f"{key}={value}"]), "--fast-dev-run",
            "--run-dir", str(tmp_path / f"run{n}"), cwd=tmp_path,
        )  # fmt: skip
        assert_clean(done, f"train --set {key}={value}")


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[data]\nname = "synthétique"\n'.encode("latin-1"))
    done = run_glassloop("train", str(path))
    assert done.returncode == 2 and "is not UTF-8 text" in done.stderr, done.stderr
    assert_clean(done, "a latin-1 file")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "-1"], "argument --nproc: must be 1 or more, got -1"),
        (["--nproc", "0"], "argument --nproc: must be 1 or more, got 0"),
        (["--set", "optim.betas=[0.9]"], "optim.betas must be a list of 2 numbers, got [0.9]"),
        (["--set", "optim.betas=[0.9, 1.5]"], "AdamW refuses these arguments"),
        (["--set", "data.batch_size=99999999999999999999"], "fits in 64 bits"),
        (["--set", "optim.lr=0"], "optim.lr must be > 0, got 0.0"),
        (["--set", "train.metrics=['top5000_accuracy']"], "needs k <= the number of classes (10)"),
        (["--set", "data.name=text-csv", "--set", "data.tokenizer=NOTES",
          "--set", "data.path=texts.csv"], "is not a tokenizer file"),
    ],
)  # fmt: skip
def test_the_reported_config_mistakes_are_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "NOTES").write_text("not a tokenizer\n")
    (tmp_path / "texts.csv").write_text("text,label\n" + "a good film,pos\na bad film,neg\n" * 20)
    done = run_glassloop(
        "train", *sets(BASE), *args, "--run-dir", str(tmp_path / "r"), cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr
    assert_clean(done, " ".join(args))
