"""One training process per run directory: an exclusive ``flock`` on ``RUN_DIR/.lock``.

Two processes writing one run directory lose work silently (the second one's checkpoints
replace the first one's; metrics.jsonl gets interleaved lines). The lock is held for the whole
of ``fit``. The kernel releases a ``flock`` when its holder dies, also by ``kill -9``, so a
lock file left behind never blocks ``--resume``: only a live holder does. The file keeps the
holder's PID for the error message.

A forked child (a ``DataLoader`` worker) inherits the descriptor, and with it the lock:
a worker stuck in a slow ``__getitem__`` after its trainer stopped would hold the run
directory against the resume. Every child therefore closes its copy at once
(``os.register_at_fork``); the parent's lock is untouched (it lasts while any descriptor of
its own is open).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from glassloop.errors import GlassloopError
from glassloop.run_dir import layout
from glassloop.storage.atomic import NOFOLLOW, refuse_link

_HELD: set[int] = set()  # this process's lock descriptors (closed in forked children)


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class RunDirLocked(GlassloopError):
    """Another live process is training in this run directory."""


class RunLock:
    """``with RunLock(run_dir):`` holds the run directory for this process.

    >>> import tempfile
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> with RunLock(run_dir):
    ...     try:
    ...         RunLock(run_dir).acquire()
    ...     except RunDirLocked as err:
    ...         print(str(err).split(" (PID")[0].replace(str(run_dir), "RUN"))
    run: 'RUN' is in use by another training process
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / layout.LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(refuse_link(self.path), os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise RunDirLocked(
                f"run: '{self.path.parent}' is in use by another training process (PID "
                f"{holder}); wait for it to finish, stop it, or choose another --run-dir"
            ) from err
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd
        _HELD.add(fd)

    def release(self) -> None:
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing drops the flock; the file stays (harmless)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
