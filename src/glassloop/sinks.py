"""Where metrics go: the console (a progress bar or plain lines), metrics.csv, metrics.jsonl.

Rows are plain dicts. A step row has ``kind="step"``; an epoch row has ``kind="epoch"``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Literal

from tqdm import tqdm

from glassloop.atomic import atomic_path, open_own

ProgressMode = Literal["auto", "bar", "lines", "none"]


def resolve_progress(
    mode: str, bar_stream: IO[str] | None = None, line_stream: IO[str] | None = None
) -> tuple[bool, bool]:
    """``(bar, lines)``: whether to draw a progress bar (on stderr) and whether to print the
    tutorial's step lines (on stdout). ``"auto"`` draws the bar when stderr is a terminal and
    prints the lines when stdout is not one, so ``glassloop train > train.log`` shows the bar
    on the terminal and writes every line to the file; CI logs get the lines."""
    if mode not in ("auto", "bar", "lines", "none"):
        raise ValueError(f"progress must be 'auto', 'bar', 'lines' or 'none', got {mode!r}")
    if mode != "auto":
        return mode == "bar", mode == "lines"
    bar_stream = bar_stream if bar_stream is not None else sys.stderr
    line_stream = line_stream if line_stream is not None else sys.stdout
    return bar_stream.isatty(), not line_stream.isatty()


class ProgressReporter:
    """Per-epoch progress — a bar (running mean loss, samples/s, ETA; validation as its own
    short bar) and/or the tutorial's plain lines — and a one-line epoch summary."""

    REFRESH_S = 0.5  # the bar's loss is read from the device at most this often

    def __init__(
        self, mode: str = "auto", stream: IO[str] | None = None, *, silent: bool = False
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.silent = silent
        self.mode = "none" if silent else mode
        self.bar, self.lines = (False, False) if silent else resolve_progress(mode)
        self._bar: Any = None
        self._total: int | None = None
        self._refreshed = 0.0
        self._epoch_seconds: list[float] = []  # each finished epoch's duration (run ETA)

    @property
    def quiet(self) -> bool:
        """Nothing but messages (``progress="none"`` or not rank 0)."""
        return not (self.bar or self.lines or self.mode != "none")

    def epoch_start(
        self, epoch: int, num_epochs: int, total_samples: int | None, done: int = 0
    ) -> None:
        """A new epoch's bar; ``done``: samples already trained in it (a resumed epoch)."""
        self._total = total_samples
        if self.bar:
            desc = f"epoch {epoch}/{num_epochs}"
            if self._epoch_seconds:  # the run's time left, from the epochs so far
                left = sum(self._epoch_seconds) / len(self._epoch_seconds)
                desc += f" (run: ~{format_duration(left * (num_epochs - epoch + 1))} left)"
            self._bar = tqdm(
                total=total_samples,
                initial=done,
                desc=desc,
                unit="sample",
                unit_scale=True,
                leave=False,
                dynamic_ncols=True,
            )

    def advance(self, num_samples: int, record: Any = None) -> None:
        """``num_samples`` more trained; with ``record`` (an :class:`EpochRecord`) the bar's
        running mean loss is refreshed when due (a host sync, at most twice a second)."""
        if self._bar is None:
            return
        self._bar.update(num_samples)
        now = time.monotonic()
        if record is not None and now - self._refreshed >= self.REFRESH_S:
            self._refreshed = now
            mean = record.mean_loss()
            if mean is not None:
                self._bar.set_postfix(loss=f"{mean:.4f}", refresh=False)

    def validation(self, loader: Iterable[Any]) -> Iterable[Any]:
        """``loader``, drawn as a short "validate" bar on a terminal."""
        if not self.bar:
            return loader
        bar: Iterable[Any] = tqdm(
            loader, desc="validate", unit="batch", leave=False, dynamic_ncols=True
        )
        return bar

    def log_step(self, loss: float, seen_in_epoch: int) -> None:
        if self.lines:
            total = "?" if self._total is None else f"{self._total:>5d}"
            print(f"loss: {loss:>7f}  [{seen_in_epoch:>5d}/{total}]", file=self.stream, flush=True)

    def epoch_end(self, row: dict[str, Any], num_epochs: int) -> None:
        if isinstance(row.get("seconds"), float):
            self._epoch_seconds.append(row["seconds"])
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.quiet:
            print(format_epoch_summary(row, num_epochs), file=self.stream, flush=True)

    def validation_row(self, row: dict[str, Any]) -> None:
        """A validation inside an epoch (``validate_every_n_steps``): its step and numbers."""
        numbers = ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.startswith("val_"))
        self.message(f"step {row['step']}: {numbers}")

    def message(self, text: str) -> None:
        """Resume notices and warnings: printed whatever the progress mode."""
        if not self.silent:
            print(text, file=self.stream, flush=True)

    def info(self, text: str) -> None:
        """The start header and end summary: not with ``progress="none"``."""
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_duration(seconds: float) -> str:
    """``"1h 05m"``, ``"3m 12s"``, ``"41s"``.

    >>> format_duration(3725), format_duration(192), format_duration(41.7)
    ('1h 02m', '3m 12s', '41s')
    """
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


# In the files, not on the summary line (which keeps the tutorial-like shape).
SUMMARY_SKIPS = (
    "kind",
    "epoch",
    "step",
    "samples",
    "lr",
    "seconds",
    "samples_per_s",
    "grad_norm",
    "max_memory_mb",
    "tokens_per_s",
    "mfu",
)


def format_epoch_summary(row: dict[str, Any], num_epochs: int) -> str:
    """``epoch 1/10  train_loss 0.4123  val_loss 0.3011  val_accuracy 91.20%  lr 1.00e-03  3.1s``"""
    parts = [f"epoch {row['epoch']}/{num_epochs}"]
    for key, value in row.items():
        if key in SUMMARY_SKIPS or value is None:
            continue
        if key.endswith("accuracy"):
            parts.append(f"{key} {100 * value:.2f}%")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}")
    if row.get("lr") is not None:
        parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"{row['seconds']:.1f}s")
    if row.get("tokens_per_s") is not None:
        parts.append(f"{row['tokens_per_s']:,.0f} tokens/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    return "  ".join(parts)


class JSONLSink:
    """One JSON object per line; non-finite floats are written as null (JSON has no NaN)."""

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
    for name in ("metrics.jsonl", "metrics.csv"):
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
    if row is None or row.get("kind") not in ("step", "epoch", "val"):
        return False
    step, epoch = _number(row, "step"), _number(row, "epoch")
    if step is None or epoch is None:
        return False
    return step <= max_step and (row["kind"] != "epoch" or epoch <= max_epoch)


def _number(row: dict[str, Any], key: str) -> int | None:
    try:
        return int(row[key])
    except (KeyError, TypeError, ValueError):
        return None
