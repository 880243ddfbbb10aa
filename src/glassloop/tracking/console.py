"""What a run prints: a tqdm progress bar or plain lines (the tutorial's ``loss: ...
[   64/60000]``), an epoch's summary, validation rows; only rank 0 talks.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

from tqdm import tqdm

from glassloop.best import is_number, shown
from glassloop.errors import GlassloopWarning
from glassloop.tracking.notebook import bar_class, in_notebook

# Ignored unless a filter asks for it (pytest -W error, warnings.simplefilter("error")): the
# console has said it, so it is never shown twice.
warnings.filterwarnings("ignore", category=GlassloopWarning, append=True)

if TYPE_CHECKING:  # (torch: this module is imported before it)
    from glassloop.state import EpochRecord


def resolve_progress(
    mode: str, bar_stream: IO[str] | None = None, line_stream: IO[str] | None = None
) -> tuple[bool, bool]:
    """``(bar, lines)``: whether to draw a progress bar (on stderr) and whether to print the
    tutorial's step lines (on stdout). ``"auto"`` draws the bar when stderr is a terminal and
    prints the lines when stdout is not one, so ``glassloop train > train.log`` shows the bar
    on the terminal and writes every line to the file; CI logs get the lines; a Jupyter
    notebook gets its bar (:func:`glassloop.tracking.notebook.bar_class`) and no step
    lines."""
    if mode not in ("auto", "bar", "lines", "none"):
        raise ValueError(f"progress must be 'auto', 'bar', 'lines' or 'none', got {mode!r}")
    if mode != "auto":
        return mode == "bar", mode == "lines"
    if in_notebook():  # a kernel's streams are no terminals: its own bar, no step lines
        return True, False
    bar_stream = bar_stream if bar_stream is not None else sys.stderr
    line_stream = line_stream if line_stream is not None else sys.stdout
    return bar_stream.isatty(), not line_stream.isatty()


class ProgressReporter:
    """Per-epoch progress — a bar (running mean loss, samples/s, ETA; validation as its own
    short bar) and/or the tutorial's plain lines — and, as a row destination
    (:class:`~glassloop.tracking.sinks.Destination`), a one-line epoch summary, the step
    lines and the mid-epoch validations' lines. ``record``: the epoch's
    :class:`~glassloop.state.EpochRecord` (the bar's running numbers, the lines' count)."""

    kinds = frozenset({"epoch", "step", "val"})

    REFRESH_S = 0.5  # the bar's loss is read from the device at most this often
    VAL_REFRESH_S = 0.1  # a validation's numbers (no training waits on them): tqdm's pace

    def __init__(
        self,
        mode: str = "auto",
        stream: IO[str] | None = None,
        *,
        silent: bool = False,
        record: EpochRecord | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.record = record
        self.silent = silent
        self.mode = "none" if silent else mode
        self.bar, self.lines = (False, False) if silent else resolve_progress(mode)
        self._tqdm = bar_class() if self.bar and in_notebook() else tqdm  # (a widget there)
        self.epoch_bar: Any = None  # the epoch's tqdm bar (None: none drawn)
        self._val_bar: Any = None
        self._shown: dict[str, str] = {}  # the last mid-epoch validation's, in the bar
        self._total: int | None = None
        self._epochs = 0  # the run's, for the epoch line
        self._refreshed = self._val_refreshed = 0.0
        self._said_uncounted = False  # (a NaN train_accuracy explained, once)
        self._epoch_seconds: list[float] = []  # each finished epoch's duration (run ETA)

    @property
    def quiet(self) -> bool:
        """Nothing but messages (``progress="none"`` or not rank 0)."""
        return not (self.bar or self.lines or self.mode != "none")

    def epoch_start(
        self, epoch: int, num_epochs: int, total_samples: int | None, done: int = 0
    ) -> None:
        """A new epoch's bar; ``done``: samples already trained in it (a resumed epoch)."""
        self._total, self._epochs = total_samples, num_epochs
        if self.bar:
            desc = f"epoch {epoch}/{num_epochs}"
            if self._epoch_seconds:  # the run's time left, from the epochs so far
                left = sum(self._epoch_seconds) / len(self._epoch_seconds)
                desc += f" (run: ~{format_duration(left * (num_epochs - epoch + 1))} left)"
            self.epoch_bar = self._tqdm(
                total=total_samples,
                initial=done,
                desc=desc,
                unit="sample",
                unit_scale=True,
                leave=False,
                dynamic_ncols=True,
            )

    def advance(self, num_samples: int) -> None:
        """``num_samples`` more trained; with a ``record`` the bar's running mean loss (and
        accuracy, when counted) is refreshed when due (a host sync, at most twice a second),
        next to the last mid-epoch validation's numbers."""
        if self.epoch_bar is None:
            return
        record = self.record
        self.epoch_bar.update(num_samples)
        now = time.monotonic()
        if record is not None and now - self._refreshed >= self.REFRESH_S:
            self._refreshed = now
            mean, accuracy = record.mean_loss(), record.accuracy()
            shown = {} if mean is None else {"loss": f"{mean:.4f}"}
            if accuracy is not None:
                shown["acc"] = f"{100 * accuracy:.2f}%"
            self.epoch_bar.set_postfix({**shown, **self._shown}, refresh=False)

    def validation(self, loader: Iterable[Any]) -> Iterable[Any]:
        """``loader``, drawn as a short "validate" bar on a terminal (its running numbers:
        :meth:`live_validation`)."""
        if not self.bar:
            return loader
        self._val_bar = self._tqdm(
            loader, desc="validate", unit="batch", leave=False, dynamic_ncols=True
        )
        self._val_refreshed = 0.0  # (its numbers from its first batch on)
        bar: Iterable[Any] = self._val_bar
        return bar

    def live_validation(self, loss_sum: Any, weight: Any, sums: Any) -> None:
        """A validation's running loss (and accuracy, a classifier's) on its bar, read from
        the device at most every ``VAL_REFRESH_S`` (:func:`glassloop.evaluate`'s ``live``)."""
        now = time.monotonic()
        if self._val_bar is None or now - self._val_refreshed < self.VAL_REFRESH_S:
            return
        self._val_refreshed = now
        shown = {}
        if float(weight):
            shown["val_loss"] = f"{float(loss_sum) / float(weight):.4f}"
        # (a classifier's sums have an accuracy; by name: this module is imported before torch)
        accuracy = sums.accuracy() if hasattr(sums, "accuracy") else None
        if accuracy is not None:
            shown["val_acc"] = f"{100 * accuracy:.2f}%"
        self._val_bar.set_postfix(shown, refresh=False)

    def write(self, row: dict[str, Any]) -> None:
        """A row as the console shows it: an epoch's summary line, a step's tutorial line, a
        mid-epoch validation's line."""
        kind = row["kind"]
        if kind == "epoch":
            self.epoch_end(row)
        elif kind == "step":
            self.log_step(row["loss"])
        else:
            self.validation_row(row)

    def log_step(self, loss: float) -> None:
        """The tutorial's line: the loss and the samples of the epoch so far (the record's)."""
        if self.lines:
            seen = sum(self.record.sizes) if self.record is not None else 0
            total = "?" if self._total is None else f"{self._total:>5d}"
            print(f"loss: {loss:>7f}  [{seen:>5d}/{total}]", file=self.stream, flush=True)

    def epoch_end(self, row: dict[str, Any]) -> None:
        if isinstance(row.get("seconds"), float):
            self._epoch_seconds.append(row["seconds"])
        if self.epoch_bar is not None:
            self.epoch_bar.close()
            self.epoch_bar = None
        self._shown = {}  # (the epoch's line says its validation's numbers)
        accuracy = row.get("train_accuracy")
        if isinstance(accuracy, float) and accuracy != accuracy and not self._said_uncounted:
            self._said_uncounted = True
            self.message(
                "warning: train_accuracy: no training label was counted this epoch (a "
                "train_step that does not call forward_backward, or targets that are not "
                "class labels): reported as NaN"
            )
        if not self.quiet:
            print(format_epoch_summary(row, self._epochs), file=self.stream, flush=True)

    def validation_row(self, row: dict[str, Any]) -> None:
        """A validation inside an epoch (``validate_every_n_steps``): its step and numbers,
        which the bar then shows until the next."""
        numbers = ", ".join(
            f"{k} {shown(k, v)}" for k, v in row.items() if k.startswith("val_") and is_number(v)
        )  # (accuracies in percent, as the bar and the epoch line show them)
        self.message(f"step {row['step']}: {numbers}")
        for key in ("val_loss", "val_accuracy"):
            if isinstance(row.get(key), float):
                value = row[key]
                text = f"{100 * value:.2f}%" if key.endswith("accuracy") else f"{value:.4f}"
                self._shown[key.replace("accuracy", "acc")] = text

    def message(self, text: str) -> None:
        """Resume notices and warnings: printed whatever the progress mode; a warning is a
        Python warning too (:class:`GlassloopWarning`: a filter, ``pytest -W error``)."""
        if text.startswith("warning: "):
            warnings.warn(text.removeprefix("warning: "), GlassloopWarning, stacklevel=2)
        if self.silent:
            return
        if self.epoch_bar is not None:  # above the bar, which is drawn again below it
            self.epoch_bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def info(self, text: str) -> None:
        """The start header and end summary: not with ``progress="none"``."""
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.epoch_bar is not None:
            self.epoch_bar.close()
            self.epoch_bar = None


def format_duration(seconds: float) -> str:
    """``"1h 05m"``, ``"3m 12s"``, ``"41s"``; under 10 s with its tenth (``"0.6s"``).

    >>> format_duration(3725), format_duration(192), format_duration(41.7), format_duration(0.64)
    ('1h 02m', '3m 12s', '41s', '0.6s')
    """
    if seconds < 10:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


# In the files, not on the summary line (which keeps the tutorial-like shape).
SUMMARY_SKIPS: tuple[str, ...] = ("kind", "epoch", "step", "samples", "lr", "seconds")
SUMMARY_SKIPS += ("checkpoint_s", "samples_per_s", "grad_norm", "max_memory_mb")
SUMMARY_SKIPS += ("tokens_per_s", "mfu")


# The numbers an epoch's line shows at most (a callback may log thousands of keys).
EPOCH_LINE_NUMBERS = 16


def format_epoch_summary(row: dict[str, Any], num_epochs: int) -> str:
    """``epoch 1/10  train_loss 0.4123  val_loss 0.3011  val_accuracy 91.20%  lr 1.00e-03  3.1s``"""
    parts, shown = [f"epoch {row['epoch']}/{num_epochs}"], 0
    numbers = [k for k, v in row.items() if k not in SUMMARY_SKIPS and isinstance(v, float)]
    for key, value in row.items():
        if key in SUMMARY_SKIPS or value is None:
            continue
        if shown == EPOCH_LINE_NUMBERS and len(numbers) > shown:  # (a callback's thousands)
            parts.append(f"(and {len(numbers) - shown:,} more in metrics.jsonl)")
            break
        shown += isinstance(value, float)
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
