"""Jupyter notebooks: whether a kernel runs this, the progress bar it shows, and what a fit gives
back shown as HTML (a ``Trainer``, its ``history``, an evaluation, a run read back with its
report's curves). IPython and ipywidgets are imported only inside a notebook, where they are
loaded already.
"""

from __future__ import annotations

import base64
import html
import importlib
import io
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from glassloop.best import shown
from glassloop.run_dir import layout


def in_notebook() -> bool:
    """A Jupyter kernel runs this (JupyterLab, Notebook, VS Code, Colab: ipykernel's shell),
    found without importing IPython: a process that has not imported it is no notebook."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and any(
        kind.__name__ == "ZMQInteractiveShell" for kind in type(shell).__mro__
    )


def bar_class() -> Any:
    """The notebook's bar: tqdm's widget (``tqdm.notebook``) with ipywidgets installed, else
    :class:`HtmlBar` (``tqdm.auto`` would fall back to a text bar, with a warning)."""
    try:
        importlib.import_module("ipywidgets")  # (tqdm.notebook's widgets)
    except ImportError:
        return HtmlBar
    return importlib.import_module("tqdm.notebook").tqdm


class HtmlBar(tqdm):  # type: ignore[misc]
    """tqdm's bar as HTML, redrawn in place through IPython's ``display_id``: a notebook
    without ipywidgets. Its text is tqdm's own; closed with ``leave=False``, it leaves none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ipython = importlib.import_module("IPython.display")
        self.html = ipython.HTML
        self.handle = ipython.display(ipython.HTML(""), display_id=True)
        super().__init__(*args, file=io.StringIO(), **kwargs)  # (no text stream: HTML only)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # closed, not left
            self.handle.update(self.html(""))
            return True
        done, total = self.format_dict["n"], self.format_dict["total"]
        meter = f"<progress value='{done}' max='{total}'></progress> " if total else ""
        text = html.escape(str(self) if msg is None else msg)
        self.handle.update(self.html(f"<div>{meter}<code>{text}</code></div>"))
        return True


class History(list[dict[str, Any]]):
    """A fit's history: its rows (one dict per epoch), as ``fit`` returns them and
    ``trainer.history`` holds them; a table in a notebook, and :meth:`frame` for pandas."""

    def frame(self) -> Any:
        """The rows as a pandas ``DataFrame`` (pandas is not a dependency: installed by you)."""
        return importlib.import_module("pandas").DataFrame(list(self))

    def _repr_html_(self) -> str:
        return rows_table(self)


def cell(key: str, value: Any) -> str:
    """A value as the console shows it: accuracies in percent, 4 significant digits."""
    if isinstance(value, float):
        text = f"{value:.2e}" if key == "lr" else f"{value:.1f}" if key == "seconds" else None
        return html.escape(text or shown(key, value))
    return html.escape("" if value is None else str(value))


def rows_table(rows: list[dict[str, Any]], title: str = "") -> str:
    """An HTML table of ``rows``: a column per key, in the order the rows first have them."""
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(k for k in row if k != "kind"))
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(k, row.get(k))}</td>" for k in keys) + "</tr>" for row in rows
    )
    caption = f"<caption>{html.escape(title)}</caption>" if title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def facts_table(facts: dict[str, str]) -> str:
    """A two-column HTML table: each fact's name and its value (facts without one left out)."""
    rows = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in facts.items()
        if v
    )
    return f"<table>{rows}</table>"


def trainer_html(trainer: Any) -> str:
    """A ``Trainer`` in a notebook: its model and optimizer, the options set, where the run is
    and how far it went, and its history."""
    from glassloop.distributed.world import unwrap_model
    from glassloop.options import TrainOptions
    from glassloop.tracking.summary import counts, described_optimizer

    model = unwrap_model(trainer.model)
    state = trainer.state
    facts = {
        "model": f"{type(model).__name__}, {counts(model)}",
        "optimizer": described_optimizer(trainer.optimizer),
        "task": trainer.task,
        "device": str(trainer.device),
        "run directory": str(trainer.run_dir) if trainer.run_dir else "none (nothing written)",
        "state": f"epoch {state.epoch}, step {state.step}, {state.samples_seen:,} samples",
    }
    # the options that differ from their defaults (glassloop.TrainOptions)
    defaults = {f.name: f.default for f in fields(TrainOptions) if f.default is not MISSING}
    changed = {k: v for k, v in trainer.options.items() if k in defaults and v != defaults[k]}
    facts.update({f"option {k}": repr(v) for k, v in changed.items() if k != "callbacks"})
    history = rows_table(trainer.record.history, "history") if trainer.record.history else ""
    return f"<div><strong>glassloop.Trainer</strong>{facts_table(facts)}{history}</div>"


class Evaluation(dict[str, Any]):
    """What ``trainer.evaluate`` returns: its numbers by name (a dict, as always); in a
    notebook its numbers, a classifier's report per class and its confusion matrix (rows:
    true class, columns: predicted; shaded by each row's share) as tables."""

    def _repr_html_(self) -> str:
        numbers = {k: v for k, v in self.items() if isinstance(v, (int, float))}
        parts = [rows_table([numbers], "evaluation")]
        report = self.get("report")
        if isinstance(report, dict):
            per_class = {k: v for k, v in report.items() if isinstance(v, dict)}
            rows = [{"class": name, **values} for name, values in per_class.items()]
            parts.append(rows_table(rows, "per class"))
        confusion = self.get("confusion")
        if isinstance(confusion, list) and confusion:
            parts.append(confusion_table(confusion))
        return "<div>" + "".join(parts) + "</div>"


def confusion_table(confusion: list[list[int]]) -> str:
    """A confusion matrix as a heat map: each cell shaded by its share of its row (the true
    class's samples), the count written in it."""
    head = "".join(f"<th>{i}</th>" for i in range(len(confusion[0])))
    body = []
    for i, row in enumerate(confusion):
        shares = [(count, count / (sum(row) or 1)) for count in row]
        cells = "".join(
            f"<td style='background:rgba(31,119,180,{share:.2f})'>{count}</td>"
            for count, share in shares
        )
        body.append(f"<tr><th>{i}</th>{cells}</tr>")
    caption = "<caption>confusion (rows: true class, columns: predicted)</caption>"
    return f"<table>{caption}<thead><tr><th></th>{head}</tr></thead>{''.join(body)}</table>"


@dataclass(repr=False)
class RunView:
    """A run directory read back (:func:`glassloop.load_run`): its summary (what ``glassloop
    runs`` prints of it), its epoch rows, and its report's pictures; in a notebook all three,
    the curves inline."""

    summary: Any  # glassloop.tracking.runs.RunSummary
    rows: list[dict[str, Any]]  # metrics.jsonl's epoch rows
    line: str  # what ``glassloop runs`` prints of it (its repr)

    def __repr__(self) -> str:
        return self.line

    @property
    def pictures(self) -> list[Path]:
        """The report's PNG files (links passed over: never read through one)."""
        folder = self.summary.path / layout.REPORT
        if folder.is_symlink() or not folder.is_dir():
            return []
        return [p for p in sorted(folder.glob("*.png")) if p.is_file() and not p.is_symlink()]

    def _repr_html_(self) -> str:
        s = self.summary
        facts = {"run": str(s.path), "status": s.status, "step": str(s.step), "epoch": str(s.epoch)}
        facts.update({"time": s.duration, "final": s.final, "best": s.best, "error": s.error})
        images = "".join(
            f"<figure style='display:inline-block'><img alt='{html.escape(p.stem)}' "
            f"src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}' "
            "style='max-width:420px'/></figure>"
            for p in self.pictures
        )
        history = rows_table(self.rows, "history") if self.rows else ""
        return f"<div>{facts_table(facts)}{history}<div>{images}</div></div>"
