"""The exceptions glassloop raises for a user's mistake (never for its own bugs).

Every user-facing error is a ``GlassloopError`` whose message is one line saying what was
wrong, what was expected and what to do. The CLI prints that line and exits with code 2;
the library raises it. Internal invariants use ``assert``.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path


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


class GlassloopWarning(UserWarning):
    """A warning the console says, as a Python warning too (ignored unless a filter asks)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint or another run file failed (disk full, quota, permissions);
    earlier checkpoints are intact. The CLI's exit code 3."""


def write_failure(
    path: Path, err: BaseException, last_good: str = "", *, safe: str = "nothing was lost"
) -> CheckpointWriteError:
    """One line for a failed write (exit code 3 in the CLI): what, where, the OS's reason,
    and what is ``safe`` (a failed checkpoint loses nothing; a failed metrics row itself).

    >>> print(write_failure(Path("runs/a"), OSError(28, "No space left on device")))
    checkpoint: could not write 'runs/a': No space left on device (ENOSPC); nothing was lost
    """
    if isinstance(err, CheckpointWriteError):
        return err
    code = errno.errorcode.get(getattr(err, "errno", None) or 0, type(err).__name__)
    reason = getattr(err, "strerror", None) or err
    tail = f", last good checkpoint: {last_good}" if last_good else ""
    return CheckpointWriteError(
        f"checkpoint: could not write '{path}': {reason} ({code}); {safe}{tail}"
    )


@contextlib.contextmanager
def writing(command: str, folder: Path, safe: str) -> Iterator[None]:
    """An ``OSError`` while ``command`` writes into ``folder`` (read-only, full, over quota)
    as one :class:`CheckpointWriteError` line (exit code 3), never a traceback; one about a
    file elsewhere (an input being read) goes on as it is.

    >>> try:
    ...     with writing("export", Path("out"), "nothing was written"):
    ...         raise OSError(28, "No space left on device", "out/m.pt")
    ... except CheckpointWriteError as err:
    ...     print(err)
    export: could not write 'out/m.pt': No space left on device (ENOSPC); nothing was written
    """
    try:
        yield
    except OSError as err:
        where = Path(err.filename) if isinstance(err.filename, str) else folder
        if where.resolve().parent != folder.resolve() and where.resolve() != folder.resolve():
            raise
        code = errno.errorcode.get(err.errno or 0, type(err).__name__)
        raise CheckpointWriteError(
            f"{command}: could not write '{where}': {err.strerror or err} ({code}); {safe}"
        ) from err
