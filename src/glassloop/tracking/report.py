"""``RUN_DIR/report/``: learning curves and a confusion matrix as PNG (matplotlib, headless),
the classification report as text, and an ``index.html`` showing the run at a glance."""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.storage.atomic import atomic_path, own_dir
from glassloop.storage.file_names import file_name

if TYPE_CHECKING:
    import torch
from glassloop.best import best_epoch, is_number
from glassloop.evaluation.metrics import format_report
from glassloop.tracking.console import format_duration
from glassloop.tracking.runs import read_epochs, read_json_object, read_rows, summarise


def write_report(
    run_dir: Path,
    *,
    evaluation: dict[str, Any] | None = None,
    class_names: list[str] | None = None,
    predicted_vs_true: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Path:
    """Write ``run_dir/report/`` from the run's files: a plot per metric; with a final
    classification ``evaluation`` its confusion matrix and per-class report; with a
    regression's ``predicted_vs_true`` values a scatter plot of them. Return index.html.

    Figures are made with ``matplotlib.figure.Figure``, not pyplot: no backend to pick, no
    global figure registry to close, and saving renders with Agg (no display needed). The
    curves get fixed margins: ``tight_layout`` measures every text by drawing the figure
    once more, which doubled a report's time (~0.2 s a plot); only the confusion matrix,
    whose labels are class names of any length, and the scatter plot still use it."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    run_dir = Path(run_dir)
    if not (run_dir / layout.METRICS_JSONL).is_file():
        raise GlassloopError(f"report: '{run_dir}' is not a run directory (no metrics.jsonl)")
    out = own_dir(run_dir / layout.REPORT)

    def curves(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
        figure = Figure(figsize=(6, 4))
        figure.subplots_adjust(left=0.13, right=0.97, bottom=0.12, top=0.92)  # (see above)
        axis = figure.subplots()
        axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
        axis.grid(alpha=0.3)
        return figure, axis

    def save(figure: Any, name: str) -> None:  # (never through a link of that name)
        with atomic_path(out / name) as tmp, warnings.catch_warnings():
            # (a name in a script the font lacks is drawn as boxes: no warning per glyph)
            warnings.filterwarnings("ignore", "Glyph .* missing from font")
            figure.savefig(tmp, dpi=100, format="png")

    rows = read_epochs(run_dir)
    epochs = [r["epoch"] for r in rows]
    images: list[tuple[str, str]] = []
    steps, losses = step_losses(run_dir)
    if len(steps) > 1:  # every step's loss, next to the epochs'
        figure, axis = curves("training loss per step", "optimizer step", "loss")
        if len(steps) <= STEP_POINTS:
            axis.plot(steps, losses, linewidth=1)
        else:  # a long run: each bucket's mean, and its lowest to highest loss shaded
            x, mean, low, high = _buckets(steps, losses, STEP_POINTS)
            axis.fill_between(x, low, high, alpha=0.25, linewidth=0, label="lowest to highest")
            size = -(-len(steps) // STEP_POINTS)  # steps per bucket (rounded up)
            axis.plot(x, mean, linewidth=1, label=f"mean of each {size:,} steps")
            axis.legend()
        save(figure, "step_loss.png")
    # One plot per metric: the losses together, then each validation metric (accuracy,
    # r2, mae, ... whatever the task and the callbacks wrote), then the learning rate.
    metrics = sorted({k for r in rows for k in r if k.startswith("val_") and k != "val_loss"})
    metrics, left_out = metrics[:MAX_METRIC_PLOTS], metrics[MAX_METRIC_PLOTS:]
    panels = [("loss.png", "loss", ["train_loss", "val_loss"])]
    # (a key is input: a run directory's files are copied and shared)
    panels += [(file_name(key, ".png"), _label(key[4:]), [key]) for key in metrics]
    panels.append(("lr.png", "learning rate", ["lr"]))
    for name, title, keys in panels:
        nan = float("nan")
        series = [(k, [float(r[k]) if is_number(r.get(k)) else nan for r in rows]) for k in keys]
        series = [(k, v) for k, v in series if any(x == x for x in v)]  # not all NaN
        if not series or not epochs:
            continue
        figure, axis = curves(title, "epoch", title)
        for key, values in series:
            axis.plot(epochs, values, marker="o", label=_label(key))
        if all(_percent(key) for key, _ in series):  # as the tables show it
            axis.yaxis.set_major_formatter(PercentFormatter(1.0))
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        axis.legend()
        save(figure, name)
        images.append((name, title))
        if name == "loss.png" and len(steps) > 1:
            images.append(("step_loss.png", "training loss per step"))
    texts: list[str] = []
    # A classifier's confusion matrix and class report; a model with a task per head: each
    # classifying head's ("<head>_confusion", its classes numbered).
    heads = [k.removesuffix("confusion") for k in evaluation or {} if k.endswith("confusion")]
    for head in heads:
        assert evaluation is not None
        confusion = evaluation[f"{head}confusion"]
        names = (class_names if not head else None) or [str(i) for i in range(len(confusion))]
        of = f" of {_label(head.rstrip('_'))}" if head else ""
        if f"{head}perplexity" in evaluation:  # a language model's vocabulary: no picture
            texts.append(f"no confusion matrix{of}: a language model's {len(names):,} tokens")
        else:
            figure, title = _confusion_figure(confusion, names, f"confusion matrix{of}")
            image = file_name(f"{head}confusion", ".png")
            save(figure, image)
            images.append((image, title))
        text = format_report(evaluation[f"{head}report"], evaluation[f"{head}accuracy"], names)
        with atomic_path(out / file_name(f"{head}classification_report", ".txt")) as tmp:
            tmp.write_text(text + "\n", encoding="utf-8")
        texts.append((f"{head.rstrip('_')}:\n" if head else "") + text)
    report_text = "\n\n".join(texts)
    if predicted_vs_true is not None:
        figure, title = _scatter_figure(*predicted_vs_true)
        save(figure, "predicted_vs_true.png")
        images.append(("predicted_vs_true.png", title))
    index = out / "index.html"
    with atomic_path(index) as tmp:
        tmp.write_text(_html(run_dir, rows, images, report_text, left_out), encoding="utf-8")
    return index


# At most this many plots of one validation metric each: a run's rows are input, and a
# callback may log thousands of keys (3,000 val_ keys drew 1,155 plots in 300 s); the rest
# are named under the plots, their numbers in the final metrics table and metrics.jsonl.
MAX_METRIC_PLOTS = 24


# The confusion matrix costs at most a second or two whatever the number of classes (1,024
# are kept, metrics.CONFUSION_MAX_CLASSES): a number in each cell up to CELL_NUMBERS_MAX
# classes, the class names on the axes up to NAMES_MAX, a plain heat map beyond; the figure
# is never larger than MAX_INCHES (a 1,024-class matrix drawn with a text per cell on a
# 514-inch figure ran for 32 minutes).
CELL_NUMBERS_MAX = 30
NAMES_MAX = 60
MAX_INCHES = 16.0
# A regression's predicted-vs-true plot draws at most this many points, a random sample
# (a fixed seed: the same report for the same outputs); the title says of how many.
SCATTER_MAX = 10_000
# The per-step loss plot draws every step up to this many; beyond, this many buckets of
# consecutive steps (each one's mean, its range shaded).
STEP_POINTS = 10_000


def _confusion_figure(confusion: list[list[int]], names: list[str], title: str) -> tuple[Any, str]:
    """The figure of a confusion matrix and its caption (which says its size and how much of
    it is labelled)."""
    from matplotlib.figure import Figure

    n = len(confusion)
    size = min(MAX_INCHES, max(4.0, 0.5 * n + 2)) if n <= NAMES_MAX else 9.0
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
    image = axis.imshow(confusion, cmap="Blues", interpolation="nearest")
    caption = f"{title}, {n:,} classes"
    if n <= NAMES_MAX:
        labels = [_label(name, 24) for name in names]
        axis.set(xticks=range(n), yticks=range(n))
        axis.set_xticklabels(
            labels, rotation=45, ha="right", fontsize=8 if n <= CELL_NUMBERS_MAX else 6
        )
        axis.set_yticklabels(labels, fontsize=8 if n <= CELL_NUMBERS_MAX else 6)
    else:
        caption += " (too many to label: the class report has each)"
        figure.colorbar(image, ax=axis, shrink=0.8)
    if n <= CELL_NUMBERS_MAX:
        top = max(max(row) for row in confusion) or 1
        for i, row in enumerate(confusion):
            for j, count in enumerate(row):
                colour = "white" if count > top / 2 else "black"
                axis.text(j, i, str(count), ha="center", va="center", color=colour, fontsize=8)
    axis.set(xlabel="predicted", ylabel="true", title=f"{caption} (validation)")
    with warnings.catch_warnings():  # (as in write_report's save)
        warnings.filterwarnings("ignore", "Glyph .* missing from font")
        figure.tight_layout()
    return figure, caption


def _scatter_figure(predicted: torch.Tensor, true: torch.Tensor) -> tuple[Any, str]:
    """A regression's predicted-vs-true plot of at most :data:`SCATTER_MAX` of its points,
    and its caption (how many of how many)."""
    import torch
    from matplotlib.figure import Figure

    predicted, true = (t.detach().float().flatten().cpu() for t in (predicted, true))
    total = len(true)
    low, high = float(min(true.min(), predicted.min())), float(max(true.max(), predicted.max()))
    if total > SCATTER_MAX:  # (a private generator: the run's global RNG stays as it is)
        generator = torch.Generator().manual_seed(0)
        kept = torch.randperm(total, generator=generator)[:SCATTER_MAX]
        predicted, true = predicted[kept], true[kept]
    figure = Figure(figsize=(5, 5))
    axis = figure.subplots()
    axis.scatter(true, predicted, s=8, alpha=0.5)
    axis.plot([low, high], [low, high], linestyle="--", color="gray")  # perfect predictions
    shown = (
        f"{total:,} validation points"
        if total <= SCATTER_MAX
        else (f"{SCATTER_MAX:,} of {total:,} validation points, at random")
    )
    axis.set(xlabel="true", ylabel="predicted", title=f"predicted vs true ({shown})")
    figure.tight_layout()
    return figure, f"predicted vs true, {shown}"


def _label(name: str, limit: int = 60) -> str:
    """A name from outside as text in a figure: one line, cut to ``limit`` characters, its
    ``$`` escaped (matplotlib reads text between two as TeX and fails on what is not)."""
    text = "".join(c if c.isprintable() else "?" for c in name)
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("$", r"\$")


def _html(
    run_dir: Path,
    rows: list[dict[str, Any]],
    images: list[tuple[str, str]],
    report: str,
    left_out: list[str],
) -> str:
    info = read_json_object(run_dir / layout.STATUS)
    config = read_json_object(run_dir / layout.CONFIG)
    last = rows[-1] if rows else {}
    summary = summarise(run_dir)
    policy = config.get("checkpoint")
    policy = policy if isinstance(policy, dict) else {}
    best = best_epoch(rows, str(policy.get("monitor") or ""), str(policy.get("mode") or "auto"))
    facts = {
        "status": summary.status if summary else info.get("status"),
        "epochs": last.get("epoch"),
        "steps": last.get("step"),
        "training time": summary.duration if summary else "-",
        "this command": _seconds(info.get("wall_s")),
        "best epoch": f"{best[2]}: {best[0]} {_fmt(best[1], best[0])}" if best else "-",
        "command": _command(info.get("argv")),
    }
    overview = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in facts.items()
    )
    metrics = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fmt(v, k))}</td></tr>"
        for k, v in last.items()
        if k != "kind"
    )
    versions = "".join(
        f"<tr><td>{k}</td><td>{html.escape(str(info.get(k)))}</td></tr>"
        for k in ("glassloop", "torch", "python", "platform", "git_sha")
        if info.get(k) is not None  # (unknown: not shown, never "None")
    )
    figures = "".join(
        f'<figure><img src="{html.escape(name)}" alt="{html.escape(title)}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
        for name, title in images
    )
    if left_out:
        names = ", ".join(left_out)
        figures += (
            f"<p>{len(left_out):,} more validation metrics are not drawn (at most "
            f"{MAX_METRIC_PLOTS} plots; their numbers are in the table above and in "
            f"metrics.jsonl): {html.escape(names)}</p>"
        )
    report_block = (
        f"<h2>Classification report</h2><pre>{html.escape(report)}</pre>" if report else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>glassloop run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}figure{{display:inline-block;
margin:0 1em 1em 0}}img{{max-width:520px}}td{{padding:0 1em 0 0}}
pre{{background:#f6f6f6;padding:1em}}</style></head><body>
<h1>Run {html.escape(run_dir.name)}</h1>
<table>{overview}</table>
<h2>Final metrics (epoch {html.escape(str(last.get("epoch", "-")))})</h2><table>{metrics}</table>
<h2>Plots</h2>{figures}
{report_block}
<h2>Versions</h2><table>{versions}</table>
<h2>Config</h2><pre>{html.escape(json.dumps(config, indent=2))}</pre>
</body></html>
"""


def _seconds(value: Any) -> str:
    """run.json's ``wall_s``: the last command's seconds since its launch."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{format_duration(float(value))} since its launch"
    return "-"


def _fmt(value: Any, name: str = "") -> str:
    """Percentages for accuracy-like metrics, 3 significant digits for other numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if _percent(name):
        return f"{100 * value:.2f}%"
    if abs(value) >= 1000:  # counts and rates: 40,000 samples, 4,850 samples/s
        return f"{value:,.0f}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _percent(name: str) -> bool:
    return name.endswith("accuracy") or name.endswith("exact_match")


def _command(argv: Any) -> str:
    """The command line that made the run, its program by name (not its full path)."""
    if not isinstance(argv, list) or not argv:
        return "-"
    return " ".join([Path(str(argv[0])).name, *map(str, argv[1:])])


def step_losses(run_dir: Path) -> tuple[list[int], list[float]]:
    """Every step's training loss in ``RUN_DIR/metrics.jsonl``, in step order: each finished
    epoch's (its ``"kind": "losses"`` row), and the logged steps (step rows, every
    ``log_every``) of an epoch not finished yet or of a run from before those rows."""
    found: dict[int, float] = {}
    for row in read_rows(run_dir, "step"):
        step = row.get("step")  # (a whole number: a hand-edited NaN or 1e400 is left out)
        if _number(row.get("loss")) and _whole(step):
            found[step] = float(row["loss"])
    for row in read_rows(run_dir, "losses"):
        first, values = row.get("first_step"), row.get("loss")
        if not _whole(first) or not isinstance(values, list):
            continue  # (a file edited by hand: what is not a list of numbers is left out)
        for i, value in enumerate(values):
            if _number(value):
                found[first + i] = float(value)
    steps = sorted(found)
    return steps, [found[step] for step in steps]


def _buckets(
    steps: list[int], losses: list[float], count: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """``count`` runs of consecutive steps: each one's middle step, mean, lowest and highest
    loss (a plot of a million steps stays a plot, drawn in a moment)."""
    size = -(-len(steps) // count)  # (rounded up)
    x, mean, low, high = [], [], [], []
    for start in range(0, len(steps), size):
        part = losses[start : start + size]
        x.append((steps[start] + steps[start + len(part) - 1]) / 2)
        mean.append(sum(part) / len(part))
        low.append(min(part))
        high.append(max(part))
    return x, mean, low, high


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
