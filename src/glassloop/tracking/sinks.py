"""Where the loop's rows go: one interface, :class:`Destination` (Composer's
``LoggerDestination`` is the precedent), for the files here (metrics.csv, metrics.jsonl,
TensorBoard), a tracker (:mod:`glassloop.tracking.trackers`) and the console
(:mod:`glassloop.tracking.console`); the run log hands each row to every destination that
takes its kind (:meth:`glassloop.tracking.run_log.RunLog.write`). Callbacks stay the user's
hook into the loop itself.

Rows are plain dicts. A step row has ``kind="step"``; an epoch row has ``kind="epoch"``; a
mid-epoch validation's ``kind="val"``; metrics.jsonl alone also takes each epoch's every step
loss, ``kind="losses"`` (:meth:`glassloop.tracking.run_log.RunLog.write_losses`).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Protocol

from glassloop.run_dir import layout
from glassloop.storage.atomic import atomic_path, open_own

ROWS = frozenset({"epoch", "step", "val"})  # the metric rows (not an epoch's step losses)


class Destination(Protocol):
    """Where rows go: ``write`` takes one row of each kind in ``kinds``."""

    @property
    def kinds(self) -> frozenset[str]: ...
    def write(self, row: dict[str, Any]) -> None: ...


class JSONLSink:
    """One JSON object per line; non-finite floats are written as null (JSON has no NaN)."""

    kinds = ROWS | {"losses"}  # (the report's per-step plot)

    def __init__(self, path: Path, *, fresh: bool = True) -> None:
        self.path = path
        self._file = open_own(path, "w" if fresh else "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# A run file's bytes that are not UTF-8 (a disk error, an editor's encoding) are read and
# written back as they are: a resume drops what is not a row, never fails on a decode.
KEEP_BYTES = "surrogateescape"


class CSVSink:
    """A CSV whose header grows with the metrics: a row with a new column (a metric a
    callback or an ``evaluate`` override adds) rewrites the file once with the wider header,
    earlier rows leaving it empty. A resumed run keeps the header it finds."""

    kinds = ROWS

    def __init__(self, path: Path, fields: list[str], *, fresh: bool = True) -> None:
        self.path = path
        new = fresh or not path.exists() or path.stat().st_size == 0
        self.fields, found = list(fields), list(fields)
        if not new:
            with path.open(encoding="utf-8", errors=KEEP_BYTES, newline="") as handle:
                found = next(csv.reader(handle), [])
            self.fields = found + [f for f in fields if f not in found]
        self._open(rewrite=new or self.fields != found)

    def _open(self, rewrite: bool) -> None:
        """Open for appending; with ``rewrite``, first write the file anew under the current
        header (the rows it holds kept)."""
        if rewrite:
            rows: list[dict[str, str]] = []
            if self.path.exists() and self.path.stat().st_size:
                with self.path.open(encoding="utf-8", errors=KEEP_BYTES, newline="") as handle:
                    rows = list(csv.DictReader(handle))
            with (
                atomic_path(self.path) as tmp,
                open_own(tmp, "w", encoding="utf-8", errors=KEEP_BYTES, newline="") as handle,
            ):
                writer = csv.DictWriter(handle, fieldnames=self.fields, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
        self._file = open_own(self.path, "a", encoding="utf-8", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.fields, extrasaction="ignore")

    def write(self, row: dict[str, Any]) -> None:
        new = [k for k, v in row.items() if k not in self.fields and _is_scalar(v)]
        if new:
            self._file.close()
            self.fields += new
            self._open(rewrite=True)
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


class TensorBoardSink:
    """Scalars for TensorBoard (the optional ``tensorboard`` package): step rows under
    ``step/<name>`` against the optimizer step, epoch rows under ``epoch/<name>`` against the
    epoch."""

    kinds = ROWS

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            from glassloop.errors import ConfigError

            raise ConfigError(
                "config: train.tensorboard needs the tensorboard package: pip install "
                "'glassloop[tensorboard]'"
            ) from err
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        kind = row.get("kind")
        x = row["step"] if kind == "step" else row["epoch"]
        for key, value in row.items():
            if key in ("kind", "epoch", "step") or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(f"{kind}/{key}", value, x)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def truncate_rows(run_dir: Path, max_step: int, max_epoch: int) -> None:
    """Drop metric rows written after the checkpoint a run resumes from (by a run that died
    after it): rows of a later step, and epoch rows of an epoch it had not finished (an
    epoch's row has the step of the checkpoint taken at its last batch, before the epoch's
    end was recorded). A resumed run's files then hold each step and each epoch once."""
    for name in (layout.METRICS_JSONL, layout.METRICS_CSV):
        path = run_dir / name
        if not path.is_file():
            continue
        with path.open(
            encoding="utf-8", errors=KEEP_BYTES, newline=""
        ) as handle:  # (a CSV's own line ends)
            text = handle.read()
        with atomic_path(path) as tmp:
            if name.endswith(".jsonl"):
                lines = text.splitlines(keepends=True)
                kept = [line for line in lines if _keep(_jsonl_row(line), max_step, max_epoch)]
                tmp.write_text("".join(kept), encoding="utf-8", errors=KEEP_BYTES)
                continue
            # Records, not lines: a quoted field may hold a newline (a header written by an
            # older glassloop from a key with one), and each record is written back as read.
            reader = csv.DictReader(io.StringIO(text, newline=""))
            rows = [row for row in reader if _keep(row, max_step, max_epoch)]
            if reader.fieldnames:  # (an empty file stays empty)
                with open_own(tmp, "w", encoding="utf-8", errors=KEEP_BYTES, newline="") as handle:
                    fields = reader.fieldnames
                    writer = csv.DictWriter(handle, fields, extrasaction="ignore")
                    writer.writeheader()
                    writer.writerows(rows)


def _jsonl_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:  # a line cut short by a kill: dropped
        return None
    return row if isinstance(row, dict) else None


def _keep(row: dict[str, Any] | None, max_step: int, max_epoch: int) -> bool:
    """A row to keep: one of a step up to ``max_step`` (an epoch's: of an epoch up to
    ``max_epoch``); a line that is no row (cut short by a kill, damaged bytes) goes."""
    if row is None or row.get("kind") not in ("step", "epoch", "val", "losses"):
        return False
    step, epoch = _number(row, "step"), _number(row, "epoch")
    if step is None or epoch is None:
        return False
    # (an epoch's every step loss, "losses", is written with its row: kept alike)
    return step <= max_step and (row["kind"] not in ("epoch", "losses") or epoch <= max_epoch)


def _number(row: dict[str, Any], key: str) -> int | None:
    try:
        return int(row[key])
    except (KeyError, TypeError, ValueError):
        return None
