"""``glassloop runs``: what the run directories under a folder hold, at a glance; one read back
(:func:`load_run`)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glassloop.best import best_epoch, shown
from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.storage.redaction import printable
from glassloop.tracking.console import format_duration
from glassloop.tracking.notebook import RunView


@dataclass
class RunSummary:
    path: Path
    status: str  # finished / interrupted / failed / running (or killed: no clean exit seen)
    step: int
    epoch: int
    best: str  # e.g. "val_accuracy 94.80% (epoch 7)"
    started: str = ""  # ISO time the run began ("" when run.json does not say)
    duration: str = "-"  # training time, e.g. "3m 12s" (run.json's train_s; older runs:
    # from started to ended)
    final: str = "-"  # the last epoch's val_accuracy (or val_loss, train_loss)
    error: str = ""  # why a failed run failed (run.json's "error")


def summarise(run_dir: Path) -> RunSummary | None:
    """The summary of one run directory, or ``None`` if it is not one."""
    try:
        info = read_json(run_dir / layout.STATUS)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        info = {"status": "unreadable run.json"}
    if not isinstance(info, dict):
        info = {"status": "unreadable run.json"}
    rows = read_epochs(run_dir)
    status = str(info.get("status", "unknown"))
    if status == "running":
        status = "running or killed"  # a clean exit always rewrites run.json
    last: dict[str, Any] = rows[-1] if rows else {}
    started, error = info.get("started"), info.get("error")
    started = started if isinstance(started, str) else ""
    error = error if isinstance(error, str) else ""
    return RunSummary(
        run_dir,
        status,
        _count(info.get("step", last.get("step"))),
        _count(info.get("epoch", last.get("epoch"))),
        best_of(run_dir, rows),
        started,
        _duration(started, info.get("ended"), info.get("train_s")),
        final_of(rows),
        error,
    )


def load_run(run_dir: str | Path) -> RunView:
    """A run directory read back: its summary, its epoch rows and its report's pictures; in a
    notebook a table with the curves inline, elsewhere the line ``glassloop runs`` prints.

    A folder that is not a run (no run.json) is a :class:`~glassloop.errors.GlassloopError`."""
    path = Path(run_dir)
    summary = summarise(path)
    if summary is None:
        raise GlassloopError(f"'{path}' is not a run directory (it has no {layout.STATUS})")
    return RunView(summary, read_epochs(path), format_runs([summary]))


def _duration(started: Any, ended: Any, train_s: Any = None) -> str:
    """``"1h 02m"``, ``"3m 12s"`` or ``"41s"``: the run's training time (run.json's
    ``train_s``; a run written before it was recorded: between its start and end)."""
    if isinstance(train_s, int | float) and not isinstance(train_s, bool) and train_s >= 0:
        return format_duration(float(train_s))
    try:
        seconds = (
            datetime.datetime.fromisoformat(str(ended)) - datetime.datetime.fromisoformat(started)
        ).total_seconds()
    except (TypeError, ValueError):
        return "-"
    return format_duration(seconds)


def _count(value: Any) -> int:
    """A step or epoch from a file that may have been edited or cut: 0 unless a count."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


EVERY_STEP = '{"kind": "losses"'  # how metrics.jsonl's "losses" rows begin (JSONLSink)


def read_rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The rows of one ``kind`` ("epoch", "step", "val", "losses") of
    ``RUN_DIR/metrics.jsonl`` (none if it is missing or unreadable); a line cut short by a
    kill, one that is not a row or not UTF-8 text, is skipped."""
    path = run_dir / layout.METRICS_JSONL
    if not path.is_file():
        return []
    try:  # (undecodable bytes, a damaged or foreign file: that line is skipped, not the rest)
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        if kind != "losses" and line.startswith(EVERY_STEP):
            continue  # (an epoch's every step loss: a long line, only the report reads it)
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict) and row.get("kind") == kind:
            rows.append(row)
    return rows


def read_epochs(run_dir: Path) -> list[dict[str, Any]]:
    """The epoch rows of ``RUN_DIR/metrics.jsonl``."""
    return read_rows(run_dir, "epoch")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of a run directory (run.json, config.json, tracking.json) as a dict;
    ``{}`` when it is missing, unreadable or not an object."""
    try:
        data = read_json(path)
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


# run.json, config.json and tracking.json are a few KB; a run directory is input (copied,
# shared): a larger one is unreadable, never parsed.
MAX_JSON_BYTES = 4 << 20


def read_json(path: Path) -> Any:
    """A run directory's JSON file, parsed (``ValueError`` when it is larger than
    :data:`MAX_JSON_BYTES` or not JSON)."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"'{path}' has {path.stat().st_size:,} bytes, over {MAX_JSON_BYTES:,}")
    return json.loads(path.read_text(encoding="utf-8"))


def best_of(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The best epoch as :mod:`glassloop.best` defines it (the run's ``checkpoint.monitor``,
    default val_loss), named: ``"val_loss 0.1735 (epoch 8)"``."""
    policy = read_json_object(run_dir / layout.CONFIG).get("checkpoint")
    policy = policy if isinstance(policy, dict) else {}
    try:
        best = best_epoch(rows, str(policy.get("monitor") or ""), str(policy.get("mode") or "auto"))
    except ValueError:  # a mode no glassloop wrote
        best = best_epoch(rows)
    return f"{best[0]} {shown(best[0], best[1])} (epoch {best[2]})" if best else "-"


def final_of(rows: list[dict[str, Any]]) -> str:
    """The last epoch's headline number: val_accuracy, else val_loss, else train_loss."""
    last = rows[-1] if rows else {}
    for key in ("val_accuracy", "val_loss", "train_loss"):
        value = last.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{key} {100 * value:.2f}%" if key.endswith("accuracy") else f"{key} {value:.4f}"
    return "-"


def list_runs(root: Path) -> list[RunSummary]:
    """Every run directory directly under ``root`` (or ``root`` itself), newest first (by
    the time it started, else the time its run.json was written)."""
    candidates = [root] if (root / layout.STATUS).is_file() else list(root.iterdir())
    found = [s for s in (summarise(p) for p in candidates if p.is_dir()) if s is not None]
    return sorted(found, key=_start_time, reverse=True)


def _start_time(summary: RunSummary) -> float:
    try:
        return datetime.datetime.fromisoformat(summary.started).timestamp()
    except ValueError:
        try:
            return (summary.path / layout.STATUS).stat().st_mtime
        except OSError:
            return 0.0


def format_runs(summaries: list[RunSummary], name: Callable[[Path], str] = str) -> str:
    """A plain table, newest run first, each run called ``name(path)`` (a remote run's local
    copy: by its URL); a failed run's error on the line below it.

    >>> print(format_runs([RunSummary(Path("runs/a"), "finished", 630, 10, "val_loss 0.2",
    ...                               duration="1m 05s", final="val_loss 0.2100")]))
    run     status    step  epoch  time    final            best
    runs/a  finished   630     10  1m 05s  val_loss 0.2100  val_loss 0.2
    """
    headers = ("run", "status", "step", "epoch", "time", "final", "best")
    rows = [  # (what run.json and the metrics say, never their control characters)
        tuple(
            printable(c, 1000)
            for c in (name(s.path), s.status, s.step, s.epoch, s.duration, s.final, s.best)
        )
        for s in summaries
    ]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(6)]
    lines = []
    for r, summary in zip([headers, *rows], [None, *summaries], strict=True):
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  "
            f"{r[3]:>{widths[3]}}  {r[4]:<{widths[4]}}  {r[5]:<{widths[5]}}  {r[6]}"
        )
        if summary is not None and summary.error:
            lines.append(f"  error: {printable(summary.error, 2000)}")
    return "\n".join(lines)
