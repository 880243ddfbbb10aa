"""The seam between the checkpointer and where its checkpoints are kept.

Every backend has the same small protocol, :class:`CheckpointStore`, and the same guarantees,
which ``tests/run_dir/test_stores.py`` runs against each (the local directory,
:class:`~glassloop.run_dir.local_store.LocalStore`, and any fsspec store,
:class:`~glassloop.run_dir.fsspec_store.FsspecStore`):

- **complete only after its manifest**: ``write`` puts a checkpoint's files in first and its
  ``manifest.json`` (size and SHA-256 of each) last; ``complete`` lists only names whose
  manifest is there; a checkpoint written again under its own name loses its manifest (or is
  swapped out whole) before its files change. A kill at any moment of a ``write`` leaves every
  checkpoint that was complete before it complete.
- **read means verified**: ``read`` gives a local folder whose every file matches the
  manifest, or raises :class:`~glassloop.errors.CheckpointError` (damage, truncation, a
  missing object): a resume falls back past it.
- **never through a link**: a symbolic link in a checkpoint, or where the store would write
  one, is refused (nothing is written, replaced or deleted through it).
- **only its own**: ``remove`` deletes a checkpoint glassloop wrote, the manifest first (a
  kill half-way leaves an incomplete one, never a damaged complete one).

A new backend is one module with one class of these four methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class CheckpointStore(Protocol):
    """Complete checkpoints by name: ``step-00000120`` (a step's) or ``best``."""

    def write(self, name: str, folder: Path) -> bool:
        """Put the complete local checkpoint ``folder`` (manifest written) in as ``name``;
        a step's also becomes the newest (``checkpoints/latest``). ``False``: ``folder``
        was replaced meanwhile and the write abandoned (``name`` left incomplete)."""
        ...

    def complete(self) -> list[str]:
        """The step checkpoints whose manifest is there, oldest first."""
        ...

    def read(self, name: str) -> Path:
        """A local folder holding ``name``, every file checked against its manifest."""
        ...

    def remove(self, name: str) -> None:
        """Delete the checkpoint ``name``, its manifest first."""
        ...
