"""The local run directory as a :class:`~glassloop.run_dir.store.CheckpointStore`:
``RUN_DIR/checkpoints/step-XXXXXXXX/`` and ``RUN_DIR/best/``, each written into a staging
folder beside it (:func:`~glassloop.run_dir.checkpoints.stage_checkpoint`) and put in place
by a rename, so a checkpoint is complete the moment it has its name; ``latest`` moves after
it, the same way. A kill at any moment leaves every earlier checkpoint as it was (leftovers
are removed at the next start: :func:`~glassloop.run_dir.checkpoints.clean_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from glassloop.errors import CheckpointWriteError, write_failure
from glassloop.run_dir.checkpoints import (
    OLD_PREFIX,
    TRASH_PREFIX,
    last_good,
    latest_pointer,
    list_checkpoints,
    looks_ours,
    mark,
    remove_marked,
    stage_checkpoint,
    step_dir_name,
)
from glassloop.run_dir.layout import BEST, CHECKPOINTS, LATEST
from glassloop.run_dir.manifest import verify_files
from glassloop.storage.atomic import (
    ForeignPathError,
    atomic_path,
    fsync_dir,
    own_dir,
    refuse_link,
    replace_own,
)
from glassloop.storage.snapshot import Snapshot


class LocalStore:
    """The checkpoints of the run directory ``run_dir``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def path(self, name: str) -> Path:
        return self.run_dir / BEST if name == BEST else self.run_dir / CHECKPOINTS / name

    def write(self, name: str, folder: Path) -> bool:
        """Rename the staged checkpoint ``folder`` to ``name`` (:func:`commit_dir`), then move
        ``latest`` to a step's; a failure removes ``folder``."""
        target = self.path(name)
        try:
            own_dir(target.parent)
            commit_dir(folder, target)
        except BaseException:
            with contextlib.suppress(OSError, ForeignPathError):
                if os.path.lexists(folder):
                    remove_marked(folder)
            raise
        if name != BEST:
            with atomic_path(target.parent / LATEST) as tmp:
                tmp.write_text(name + "\n", encoding="utf-8")
        return True  # (a rename: never abandoned half-way)

    def complete(self) -> list[str]:
        return [path.name for path in list_checkpoints(self.run_dir)]

    def read(self, name: str) -> Path:
        path = refuse_link(self.path(name))
        verify_files(path)
        return path

    def remove(self, name: str) -> None:
        """Renamed out of the way first: a kill half-way through the deletion leaves a
        ``.trash-`` folder that the next start removes, never a damaged step folder."""
        path = refuse_link(self.path(name))
        trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
        mark(path)
        replace_own(path, trash)
        remove_marked(trash)

    def commit(self, snap: Snapshot, *, best: bool = False, staged: Path | None = None) -> Path:
        """Write ``snap`` as ``best/`` (replacing the previous best) or as
        ``checkpoints/step-<step>/``, which becomes ``latest``; its path. A checkpoint of the
        same step is replaced: the state after an epoch's end (evaluation, scheduler step,
        history) differs from the state after its last batch. A failed write keeps every
        earlier checkpoint and raises :class:`CheckpointWriteError` naming the last good one
        (the weights were checked to be finite before the snapshot was taken)."""
        name = BEST if best else step_dir_name(snap.step)
        target = self.path(name)
        try:
            own_dir(target.parent)
            self.write(name, stage_checkpoint(target, snap, staged=staged))
        except OSError as err:
            if best:
                raise CheckpointWriteError(
                    f"checkpoint: could not write '{target}': {err.strerror or err}; the "
                    "previous best checkpoint is intact"
                ) from err
            raise write_failure(target, err, last_good(self.run_dir)) from err
        return target

    def prune(self, keep_last: int, keep: Path | None = None) -> list[Path]:
        """Delete all but the newest ``keep_last`` of our checkpoints; never the one ``latest``
        names, nor ``keep`` (one being uploaded), nor a folder glassloop did not create."""
        latest = latest_pointer(self.run_dir)
        kept = {keep.name} if keep is not None else set()
        removed = []
        newest = latest.name if latest is not None else None
        for name in prunable(self.complete(), keep_last, newest, kept):
            try:
                self.remove(name)
            except OSError as err:
                raise CheckpointWriteError(
                    f"checkpoint: could not remove the old checkpoint '{self.path(name)}': "
                    f"{err.strerror or err}; the newer checkpoints are intact"
                ) from err
            removed.append(self.path(name))
        return removed


def commit_dir(tmp: Path, target: Path) -> None:
    """Rename the staged folder ``tmp`` to ``target``. An existing ``target`` must be a folder
    glassloop wrote (a checkpoint of the same step, ``best/``): it is swapped out with two
    renames (a cut between them is undone at the next start) and removed after. A link or
    a folder of someone else's there is refused and left as it is."""
    if not os.path.lexists(refuse_link(target)):
        replace_own(tmp, target)
    elif not (target.is_dir() and looks_ours(target)):
        raise ForeignPathError(
            f"checkpoint: '{target}' exists and is not a checkpoint glassloop wrote; "
            "glassloop left it untouched: move it away, or choose another run directory"
        )
    else:
        old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}"
        mark(target)
        replace_own(target, old)
        try:
            replace_own(tmp, target)
        except BaseException:
            os.replace(old, target)  # put the previous one back before reporting
            raise
        # Committed: a failure to remove the previous one leaves a marked ".old-" folder
        # that the next start removes.
        with contextlib.suppress(OSError):
            remove_marked(old)
    fsync_dir(target.parent)


def prunable(complete: list[str], keep_last: int, latest: str | None, keep: set[str]) -> list[str]:
    """Which of the ``complete`` checkpoints (oldest first) pruning removes: all but the newest
    ``keep_last``, never ``latest`` or one newer (a resume from an older one replaces those
    as it goes), never one in ``keep`` (being uploaded). ``keep_last`` 0: none.

    >>> prunable(["step-1", "step-2", "step-3", "step-4"], 2, "step-4", {"step-1"})
    ['step-2']
    """
    if keep_last < 1:
        return []
    kept = set(complete[-keep_last:]) | keep
    return [n for n in complete if n not in kept and (latest is None or n < latest)]
