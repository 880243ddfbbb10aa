"""Durable, link-safe file operations: the one place glassloop creates, replaces and deletes.

A symbolic link where glassloop keeps its own file or folder is foreign: it is never written
through, replaced or removed, and the operation stops with :class:`ForeignPathError` (exit
code 2) naming it. Decisions use ``lstat``; files are created with ``O_EXCL | O_NOFOLLOW`` and
opened with ``O_NOFOLLOW``; a folder is emptied through descriptors opened with
``O_NOFOLLOW``, so a link swapped in can never lead a delete outside it. Links *above* the
folders glassloop owns (a run directory or a cache on another disk) are the user's own set-up
and are followed as usual.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from glassloop.errors import GlassloopError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class ForeignPathError(GlassloopError):
    """A symbolic link (or another foreign thing) where glassloop keeps its own file."""


def refuse_link(path: Path) -> Path:
    """``path``, if it is not a symbolic link (it need not exist).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "link").symlink_to(d)
    >>> refuse_link(d / "link")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    glassloop.storage.atomic.ForeignPathError: run: '.../link' is a symbolic link where ...
    """
    if os.path.islink(path):
        raise ForeignPathError(
            f"run: '{path}' is a symbolic link where glassloop keeps its own files; glassloop "
            "never writes, replaces or deletes through a link and left it and its target "
            "untouched: remove the link, or choose another run directory"
        )
    return path


def own_dir(path: Path) -> Path:
    """Create the folder ``path`` (and missing parents) unless it is a link; return it."""
    refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path)  # (a link that appeared meanwhile)
    return path


def _no_follow(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | NOFOLLOW, 0o644)
    except OSError as err:
        if os.path.islink(path):
            refuse_link(Path(path))
        raise err


def open_own(path: Path, mode: str, **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` that never follows a link at ``path`` (for appending)."""
    return open(path, mode, opener=_no_follow, **kwargs)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    with open_own(path, "rb+") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a new, empty temporary file next to ``target``; on success fsync it and rename it
    into place, so a reader sees the old file or the new one, never half of one. A link at
    ``target`` or at the temporary name is refused, never written through or replaced.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> with atomic_path(d / "x.txt") as tmp: _ = tmp.write_text("hi")
    >>> (d / "x.txt").read_text()
    'hi'
    """
    target = refuse_link(Path(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if os.path.lexists(refuse_link(tmp)):  # our own, left by a process of the same pid
        tmp.unlink()
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644))
    try:
        yield tmp
        fsync_file(tmp)
        replace_own(tmp, target)
        fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # (unlink removes a link itself, never what it points to)


def replace_own(source: Path, target: Path) -> None:
    """``os.replace`` into ``target`` unless ``target`` is a link (renaming never follows
    ``source``)."""
    os.replace(source, refuse_link(target))


def remove_tree(path: Path, *, last: str | None = None) -> None:
    """Delete the folder ``path`` and everything in it (``last``, a marker file, goes last,
    so a kill half-way leaves a folder that is still recognisably glassloop's). Never
    follows a link: ``path`` itself must not be one, and links inside are removed as links."""
    if stat.S_ISLNK(os.lstat(path).st_mode):
        refuse_link(path)
    fd = os.open(path, os.O_RDONLY | DIRECTORY | NOFOLLOW)
    try:
        _empty(fd, keep=last)
        if last is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(last, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)  # (fails on a link swapped in meanwhile: rmdir never follows one)


def _empty(fd: int, keep: str | None = None) -> None:
    with os.scandir(fd) as entries:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in names:
        if name == keep:
            continue
        if is_dir:
            inner = os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=fd)
            try:
                _empty(inner)
            finally:
                os.close(inner)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
