"""``SWEEP_DIR/report/``: the sweep at a glance: the optimization history (each complete
trial's metric, and the best so far), each parameter against the metric, and a table of the
trials (state, parameters, metric, run directory). Figures as the run report makes them
(``matplotlib.figure.Figure``, saved with Agg: no display, no pyplot state)."""

from __future__ import annotations

import html
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glassloop.storage.atomic import atomic_path, own_dir

if TYPE_CHECKING:
    import optuna


def sweep_report(study: optuna.Study, folder: Path) -> Path:
    """Write ``folder/report/`` for ``study``; return its index.html."""
    from matplotlib.figure import Figure

    out = own_dir(folder / "report")
    metric = str(study.user_attrs.get("metric", "value"))
    done = [t for t in study.trials if t.state.name == "COMPLETE" and t.value is not None]
    better = min if study.direction.name == "MINIMIZE" else max
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
        for t in study.trials
    )
    head = "".join(f"<th>{h}</th>" for h in ("trial", "state", "parameters", metric, "run"))
    images = "".join(f'<p><img src="{file}" alt="{file}"></p>' for file, _ in figures)
    index = out / "index.html"
    with atomic_path(index) as tmp:
        tmp.write_text(
            f"<!doctype html><meta charset='utf-8'><title>sweep {html.escape(str(folder))}"
            f"</title><h1>Sweep: {len(study.trials)} trials</h1>{images}"
            f"<table border='1'><tr>{head}</tr>{rows}</table>",
            encoding="utf-8",
        )
    return index


def _row(trial: Any) -> list[Any]:
    values = ", ".join(f"{key}={value}" for key, value in trial.params.items())
    value = "" if trial.value is None else f"{trial.value:.6g}"
    return [trial.number, trial.state.name.lower(), values, value, f"trial-{trial.number:04d}"]
