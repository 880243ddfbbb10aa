"""``glassloop tune``: a hyperparameter search, each trial a normal run
(:func:`glassloop.tuning.sweep.tune`). Declared and run here; :func:`add_tune_command` adds it
to the parser of :mod:`glassloop.cli.main`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any


def add_tune_command(
    commands: argparse._SubParsersAction[Any], count: Callable[[str], int]
) -> None:
    """``glassloop tune``; ``count``: the argparse type of a whole number of 1 or more."""
    tune = commands.add_parser(
        "tune",
        help="search hyperparameters with Optuna: each trial a normal run in DIR/trial-NNNN",
        description="Search the keys, ranges and choices of SPACE.toml over runs of CONFIG "
        "(Optuna; pip install 'glassloop[search]'). The study is DIR/study.db; each trial a "
        "normal run directory DIR/trial-NNNN (glassloop train DIR/trial-NNNN/config.json "
        "reproduces it). The same command on the same DIR continues the sweep: a trial that "
        "was running resumes from its checkpoint. A pruner stops a trial whose epoch rows "
        "fall behind (it saves a checkpoint; run.json says pruned). See docs/search.md.",
    )
    tune.add_argument(
        "config", nargs="?", metavar="CONFIG", help="TOML config file (default: built-in demo)"
    )
    tune.add_argument(
        "--space",
        required=True,
        metavar="SPACE.toml",
        help="metric, direction, pruner and [space]: a range or choices for each config key",
    )
    tune.add_argument(
        "--trials", type=count, required=True, metavar="N", help="the sweep ends with N trials"
    )
    tune.add_argument(
        "--sweep-dir",
        required=True,
        metavar="DIR",
        help="the study (DIR/study.db) and one run directory per trial (DIR/trial-NNNN)",
    )
    tune.add_argument(
        "--workers",
        type=count,
        default=1,
        metavar="K",
        help="run K trials side by side on this machine, each its own process (default 1)",
    )
    tune.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key in every trial (repeatable), as for train",
    )
    tune.add_argument(
        "--backend",
        choices=("optuna", "ray"),
        default="optuna",
        help="optuna (default): trials as processes on this machine; ray: Ray Tune on the "
        "Ray cluster RAY_ADDRESS names (else a local one), checkpoints in DIR/ray",
    )


def cmd_tune(args: argparse.Namespace) -> int:
    """The sweep, a line per trial; last, the best trial, its metric and its config."""
    from glassloop.tuning.sweep import SweepStopped, tune

    try:
        tune(
            args.config,
            args.space,
            trials=args.trials,
            sweep_dir=args.sweep_dir,
            workers=args.workers,
            overrides=args.overrides,
            backend=args.backend,
            say=lambda line: print(line, flush=True),
        )
    except SweepStopped as stop:
        again = shlex.join(["glassloop", *args.argv])
        print(f"glassloop: tune {stop}; the running trials saved a checkpoint", file=sys.stderr)
        print(f"glassloop: continue the sweep with: {again}", file=sys.stderr)
        return stop.exit_code
    return 0
