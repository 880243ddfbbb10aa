"""The exceptions glassloop raises for a user's mistake (never for its own bugs).

Every user-facing error is a ``GlassloopError`` whose message is one line saying what was
wrong, what was expected and what to do. The CLI prints that line and exits with code 2;
the library raises it. Internal invariants use ``assert``.
"""

from __future__ import annotations


class GlassloopError(ValueError):
    """A mistake in the user's config, data, model or files; the message is the whole story."""


class ConfigError(GlassloopError):
    """An unknown, mistyped or inconsistent configuration key."""


class DataError(GlassloopError):
    """Data that cannot be trained on: missing files, empty sets, labels out of range."""


class ModelError(GlassloopError):
    """A model that cannot be built or that rejects the data it is given."""


class NonFiniteError(GlassloopError):
    """Training produced a NaN/inf loss (``train.nonfinite = "raise"``, or too many skips)."""


class CheckpointError(GlassloopError):
    """A checkpoint that cannot be read, does not fit, or cannot be written."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint or another run file failed (disk full, quota, permissions);
    earlier checkpoints are intact. The CLI's exit code 3."""
