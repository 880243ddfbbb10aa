"""A sweep, an Optuna study whose trials are normal glassloop runs (each a ``glassloop train``
subprocess writing ``SWEEP_DIR/trial-NNNN/``), up to ``workers`` at once.

::

    SWEEP_DIR/
      study.db            the study (optuna's RDB storage on SQLite)
      trial-0003/         a normal run directory: config.json, metrics.jsonl, checkpoints/
      trial-0003.log      what the trial's process printed

The same call on the same folder continues the sweep: finished, pruned and failed trials are
kept; a trial still "running" in the study (its sweep was killed) is resumed from its newest
checkpoint with ``glassloop train --run-dir SWEEP_DIR/trial-NNNN --resume``, never restarted;
new trials are asked for until the study holds ``trials``.

Why SQLite and not optuna's JournalStorage: one process writes the study, this one. The
trials are plain training processes that write only their run directories; the sweep reads
their epoch rows and reports them itself. With one writer SQLite's lock is never contended,
and study.db is one file that ``optuna.load_study`` and optuna-dashboard open as it is
(JournalStorage is for several processes writing one study, which never happens here).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from glassloop.distributed.preemption import StopSignals, die_with_parent
from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.storage.serialization import write_json
from glassloop.tracking.runs import read_json_object
from glassloop.tuning.ray_sweep import run_ray_sweep
from glassloop.tuning.report import INDEX, TrialRecord, mark_pruned, summarise
from glassloop.tuning.space import Space, read_space, require

if TYPE_CHECKING:
    import optuna

STUDY = "study.db"
STUDY_NAME = "glassloop"
POLL_S = 0.1  # how often the running trials' metrics.jsonl are read (a few bytes each)
TAIL = 256  # bytes of metrics.jsonl compared before reading on (a row holds a step number)
STOP_WAIT_S = 120  # a stopped trial's checkpoint write; then it is killed


class SweepStopped(Exception):
    """The sweep stopped on a signal; its running trials were stopped with a checkpoint and
    stay "running" in the study, for the same command to resume."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def tune(
    config: str | Path | None,
    space: str | Path,
    *,
    trials: int,
    sweep_dir: str | Path,
    workers: int = 1,
    overrides: Sequence[str] = (),
    backend: str = "optuna",
    say: Callable[[str], None] = print,
) -> Any:
    """Search ``space`` (a SPACE.toml, :mod:`glassloop.tuning.space`) over runs of ``config``
    with ``overrides``; the optuna study, once it holds ``trials`` trials, finished, pruned or
    failed (``backend="ray"``: Ray Tune's ``ResultGrid``, :mod:`glassloop.tuning.ray_sweep`).
    Its last lines (``say``) name its report, the best trial, its metric and its config.

    >>> study = glassloop.tune("my.toml", "s.toml", trials=20, sweep_dir="sw")  # doctest: +SKIP
    >>> study.best_trial.number, study.best_value  # doctest: +SKIP
    (7, 0.1734)
    """
    optuna = require("optuna", "search")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # (the sweep says each trial itself)
    if trials < 1 or workers < 1:
        raise GlassloopError(f"tune: trials and workers must be 1 or more, got {trials}, {workers}")
    if backend not in ("optuna", "ray"):
        raise GlassloopError(f"tune: backend must be 'optuna' or 'ray', got {backend!r}")
    checked = read_space(space, config, overrides, backend)  # (before anything is written)
    folder = Path(sweep_dir)
    folder.mkdir(parents=True, exist_ok=True)
    keys = [p.key for p in checked.params]  # (SWEEP_DIR/sweep.json: what runs DIR reads)
    write_json(folder / INDEX, {"backend": backend, "metric": checked.metric, "keys": keys})
    if backend == "ray":
        result, records = run_ray_sweep(checked, config, overrides, folder, trials, workers, say)
    else:
        result = optuna.create_study(
            storage=f"sqlite:///{folder.resolve() / STUDY}",
            study_name=STUDY_NAME,
            direction=checked.direction,
            pruner=checked.pruner,
            load_if_exists=True,
        )
        result.set_user_attr("metric", checked.metric)
        # A continued sweep's sampler seeded anew past the trials it holds: the same seed
        # again drew the first trials' values again (trial 2 of a killed sweep was trial 0).
        result.sampler = optuna.samplers.TPESampler(seed=checked.seed + len(result.trials))
        Sweep(result, checked, config, list(overrides), folder, say).run(trials, workers)
        records = [
            TrialRecord(t.number, t.state.name.lower(), t.params, t.value) for t in result.trials
        ]
    summarise(records, checked.metric, checked.direction, folder, say)
    return result


@dataclass
class Running:
    """A running trial: its process and what the sweep has read of its epoch rows."""

    trial: optuna.Trial
    run_dir: Path
    process: subprocess.Popen[bytes]
    log: BinaryIO  # what the process prints: DIR/trial-NNNN.log
    reported: set[int]  # epochs already reported to the study (a resumed trial's too)
    read: int = 0  # bytes of metrics.jsonl read
    tail: bytes = b""  # the last bytes read: still there, or the file was rewritten
    last: float | None = None  # the metric at the newest epoch
    epoch: int = 0
    pruned: bool = False


class Sweep:
    """Runs the study's trials as subprocesses: starts, reads, prunes, resumes, stops them."""

    def __init__(
        self,
        study: optuna.Study,
        space: Space,
        config: str | Path | None,
        overrides: list[str],
        folder: Path,
        say: Callable[[str], None],
    ) -> None:
        self.study, self.space, self.folder, self.say = study, space, folder, say
        self.config, self.overrides = config, overrides
        self.signals = StopSignals(["TERM", "INT"])  # (a second one: abort, as train does)

    def run(self, trials: int, workers: int) -> None:
        """Keep ``workers`` trials running until the study holds ``trials``; on SIGTERM or
        SIGINT stop the running ones (each saves a checkpoint) and raise :class:`SweepStopped`."""
        optuna = require("optuna", "search")
        running_state = (optuna.trial.TrialState.RUNNING,)
        waiting = self.study.get_trials(states=running_state)  # (its sweep was killed)
        running: list[Running] = []
        with self.signals:
            try:
                while not self.signals.received:
                    while len(running) < workers and (waiting or len(self.study.trials) < trials):
                        if waiting:  # (optuna's Trial of a stored one: its private id)
                            old = waiting.pop(0)
                            again = optuna.trial.Trial(self.study, old._trial_id)
                            running.append(self._start(again, set(old.intermediate_values)))
                        else:
                            running.append(self._start(self.study.ask(), set()))
                    if not running:
                        return
                    for trial in running:
                        self._read(trial)
                    for trial in [t for t in running if t.process.poll() is not None]:
                        self._finish(trial)
                        running.remove(trial)
                    time.sleep(POLL_S)
            finally:
                self._stop(running)
        raise SweepStopped(self.signals.received or 0)

    def _trust(self, run_dir: Path) -> list[str]:
        """``--trust-code`` for a trial's resume when its config.json names the model class this
        sweep's own config names: a planted trial folder naming other code is refused (exit 2)."""
        from glassloop.config.schema import load_config

        ours = load_config(self.config, self.overrides, trust_code=True).model.target
        model = read_json_object(run_dir / layout.CONFIG).get("model")
        written = model.get("target") if isinstance(model, dict) else None
        return ["--trust-code"] if ours and written == ours else []

    def _start(self, trial: optuna.Trial, reported: set[int]) -> Running:
        """A new trial's run, or a trial of a killed sweep resumed from its checkpoint."""
        run_dir = self.folder / f"trial-{trial.number:04d}"
        values = self.space.overrides(trial)  # (a resumed trial: the values it was given)
        train = [sys.executable, "-m", "glassloop", "train"]
        if (run_dir / layout.CONFIG).is_file():
            command = [*train, "--run-dir", str(run_dir), "--resume", *self._trust(run_dir)]
            self.say(f"trial {trial.number}: resumed from its newest checkpoint ({run_dir})")
        else:
            config = [] if self.config is None else [str(self.config)]
            sets = [f"--set={item}" for item in [*self.overrides, *values]]
            command = [*train, *config, *sets, "--run-dir", str(run_dir)]
            self.say(f"trial {trial.number}: {' '.join(values)} ({run_dir})")
        log = (self.folder / f"{run_dir.name}.log").open("ab")
        # Its own process group: Ctrl-C reaches the sweep alone, which stops each trial with
        # one SIGTERM (a second signal would abort a trial's checkpoint write); and it dies
        # with the sweep (a kill -9 of the sweep leaves no trial training on).
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return Running(trial, run_dir, process, log, reported)

    def _read(self, trial: Running) -> None:
        """Report the trial's new epoch rows to the study; stop it (SIGTERM: it saves a
        checkpoint) when the pruner says so."""
        path = trial.run_dir / layout.METRICS_JSONL
        try:
            with path.open("rb") as rows:
                rows.seek(max(trial.read - TAIL, 0))
                if rows.read(min(trial.read, TAIL)) != trial.tail:
                    # Rewritten since the last read (a resumed run drops the rows after its
                    # checkpoint): read from the start again; reported epochs are skipped.
                    trial.read, trial.tail = 0, b""
                    rows.seek(0)
                text = rows.read()
        except FileNotFoundError:
            return
        whole = text[: text.rfind(b"\n") + 1]  # (a row being written: read next time)
        trial.read, trial.tail = trial.read + len(whole), (trial.tail + whole)[-TAIL:]
        metric = self.space.metric
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # (a line cut short by a kill, dropped by the resumed run)
            if row.get("kind") != "epoch" or trial.pruned:
                continue
            if metric not in row:  # (a name the config allows but the runs never write)
                names = ", ".join(k for k in row if k.startswith(("val_", "train_")))
                raise GlassloopError(
                    f"tune: the trials' epoch rows have no {metric!r} (they have {names}); "
                    "set metric in the space file"
                )
            value = row[metric]
            if not isinstance(value, int | float) or math.isnan(value):
                continue  # (non-finite: written as null)
            trial.last, trial.epoch = float(value), int(row["epoch"])
            if trial.epoch in trial.reported:
                continue
            trial.trial.report(trial.last, step=trial.epoch)
            trial.reported.add(trial.epoch)
            if trial.trial.should_prune() and trial.process.poll() is None:
                trial.pruned = True
                trial.process.send_signal(signal.SIGTERM)

    def _finish(self, trial: Running) -> None:
        """Tell the study how the trial's process ended."""
        optuna = require("optuna", "search")
        self._read(trial)  # (the rows written after the last read)
        trial.log.close()
        number, code, metric = trial.trial.number, trial.process.returncode, self.space.metric
        if trial.pruned:
            self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED)
            mark_pruned(trial.run_dir)
            self.say(f"trial {number}: pruned at epoch {trial.epoch} ({metric} {trial.last:.6g})")
        elif code == 0 and trial.last is not None:
            self.study.tell(trial.trial, trial.last)
            self.say(f"trial {number}: {metric} {trial.last:.6g}")
        elif code in (128 + signal.SIGTERM, 128 + signal.SIGINT) and self.signals.received:
            return  # (stopped with the sweep: still running in the study, resumed next time)
        else:
            why = f"exit code {code}" if code else f"no {metric} in its epoch rows"
            self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
            self.say(f"trial {number}: failed ({why}; see {trial.run_dir}.log)")

    def _stop(self, running: list[Running]) -> None:
        """Stop the running trials, one SIGTERM each (they checkpoint and exit), and wait."""
        for trial in running:
            if trial.process.poll() is None:
                trial.process.send_signal(signal.SIGTERM)
        for trial in running:
            try:
                trial.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                trial.process.kill()
                trial.process.wait()
            trial.log.close()
