"""The sweep at a glance, whichever backend ran it: ``SWEEP_DIR/report/`` (the optimization
history: each complete trial's metric and the best so far; each parameter against the metric;
a table of the trials) and ``glassloop runs SWEEP_DIR`` (:func:`list_trials`: a row per trial,
its status, parameters and metric). Figures as the run report makes them
(``matplotlib.figure.Figure``, saved with Agg: no display, no pyplot state)."""

from __future__ import annotations

import html
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glassloop.best import shown
from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.storage.atomic import atomic_path, own_dir
from glassloop.storage.redaction import printable
from glassloop.storage.serialization import write_json
from glassloop.tracking.runs import list_runs, read_epochs, read_json_object

INDEX = "sweep.json"  # SWEEP_DIR's: the backend, the metric, the searched keys


@dataclass(frozen=True)
class TrialRecord:
    """A trial: its state ("complete", "pruned", "fail", "running"), values and metric."""

    number: int
    state: str
    params: dict[str, Any]
    value: float | None = None


def list_trials(folder: Path) -> str:
    """``glassloop runs SWEEP_DIR``: a row per trial folder, in trial order: its status (as
    its run.json says: finished, pruned, ...), its last epoch's metric, the searched keys'
    values (as its config.json holds them)."""
    index = read_json_object(folder / INDEX)
    metric, keys = str(index.get("metric", "val_loss")), index.get("keys")
    keys = [str(k) for k in keys] if isinstance(keys, list) else []
    rows: list[list[str]] = [["trial", "status", "epoch", metric, "params"]]
    for run in sorted(list_runs(folder), key=lambda summary: summary.path.name):
        config = read_json_object(run.path / layout.CONFIG)
        values = [f"{key}={json.dumps(_lookup(config, key))}" for key in keys]
        epochs = read_epochs(run.path)
        value = epochs[-1].get(metric) if epochs else None
        got = shown(metric, value) if isinstance(value, float | int) else "-"
        row = (run.path.name, run.status, str(run.epoch), got, ", ".join(values))
        rows.append([printable(cell, 1000) for cell in row])
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    aligned = [[row[0], row[1], row[2].rjust(widths[2]), row[3], row[4]] for row in rows]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, [*widths, 0], strict=True)).rstrip()
        for row in aligned
    )


def _lookup(config: Any, key: str) -> Any:
    """The value of a dotted key (``model.kwargs.width``) in a nested config, or None."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def mark_pruned(run_dir: Path) -> None:
    """run.json's status "pruned", the rest of it as the run wrote it at its stop (its process
    has exited: nothing else writes the file), so ``glassloop runs`` shows it."""
    path = run_dir / layout.STATUS
    write_json(path, {**read_json_object(path), "status": "pruned"})


def summarise(
    trials: list[TrialRecord], metric: str, direction: str, folder: Path, say: Any
) -> None:
    """Write the sweep's report and say its last lines: the report, the trials' states, the
    best trial, its metric and its config (none completed: a :class:`GlassloopError`)."""
    say(f"report: {sweep_report(trials, metric, direction, folder)}")
    states = [t.state for t in trials]
    counts = [f"{states.count(s)} {s}" for s in ("complete", "pruned", "fail") if s in states]
    say(f"sweep: {len(states)} trials ({', '.join(counts)}) in {folder}")
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    if not done:
        raise GlassloopError(f"tune: no trial completed (the trials' output: {folder})")
    sign = 1.0 if direction == "minimize" else -1.0
    best = min(done, key=lambda t: (sign * float(t.value or 0.0), t.number))
    config = folder / f"trial-{best.number:04d}" / layout.CONFIG
    values = ", ".join(f"{key}={value}" for key, value in best.params.items())
    say(f"best trial: {best.number}, {metric} {best.value:.6g} ({values})")
    say(f"its config: {config} (glassloop train {config} reproduces it)")


def sweep_report(trials: list[TrialRecord], metric: str, direction: str, folder: Path) -> Path:
    """Write ``folder/report/`` for ``trials``; return its index.html."""
    from matplotlib.figure import Figure

    out = own_dir(folder / "report")
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    better = min if direction == "minimize" else max
    value = {t.number: float(t.value or 0.0) for t in done}
    figures = []
    if done:
        figure = Figure(figsize=(6, 4))
        axis = figure.subplots()
        axis.plot(list(value), list(value.values()), "o", label="trial")
        best = list(itertools.accumulate(value.values(), better))  # (the best so far)
        axis.step([t.number for t in done], best, where="post", label="best so far")
        axis.set(xlabel="trial", ylabel=metric, title="Optimization history")
        axis.legend()
        figures.append(("history.png", figure))
    for name in sorted({key for t in done for key in t.params}):
        tried = [t for t in done if name in t.params]
        values = [t.params[name] for t in tried]
        figure = Figure(figsize=(6, 4))
        axis = figure.subplots()
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            axis.plot(values, [value[t.number] for t in tried], "o")
            if min(values) > 0 and max(values) / min(values) > 100:  # (a log range, as drawn)
                axis.set_xscale("log")
        else:  # choices: one column each, in the order they were first tried
            labels = list(dict.fromkeys(map(str, values)))
            columns = [labels.index(str(v)) for v in values]
            axis.plot(columns, [value[t.number] for t in tried], "o")
            axis.set_xticks(range(len(labels)), labels)
        axis.set(xlabel=name, ylabel=metric, title=f"{name} against {metric}")
        figures.append((f"param-{len(figures)}.png", figure))
    for file, figure in figures:
        figure.subplots_adjust(left=0.15, right=0.97, bottom=0.13, top=0.91)
        with atomic_path(out / file) as tmp:  # (never through a link of that name)
            figure.savefig(tmp, dpi=100, format="png")
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in _row(t)) + "</tr>"
        for t in trials
    )
    head = "".join(f"<th>{h}</th>" for h in ("trial", "state", "parameters", metric, "run"))
    images = "".join(f'<p><img src="{file}" alt="{file}"></p>' for file, _ in figures)
    index = out / "index.html"
    with atomic_path(index) as tmp:
        tmp.write_text(
            f"<!doctype html><meta charset='utf-8'><title>sweep {html.escape(str(folder))}"
            f"</title><h1>Sweep: {len(trials)} trials</h1>{images}"
            f"<table border='1'><tr>{head}</tr>{rows}</table>",
            encoding="utf-8",
        )
    return index


def _row(trial: TrialRecord) -> list[Any]:
    values = ", ".join(f"{key}={value}" for key, value in trial.params.items())
    value = "" if trial.value is None else f"{trial.value:.6g}"
    return [trial.number, trial.state, values, value, f"trial-{trial.number:04d}"]
