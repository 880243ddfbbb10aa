"""Any fsspec filesystem (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``) as a
:class:`~glassloop.run_dir.store.CheckpointStore`: a checkpoint is a folder of objects,
``URL/checkpoints/step-XXXXXXXX/`` or ``URL/best/``, complete once its ``manifest.json`` is
there (uploaded last, read back byte for byte; ``latest`` moved after it).

Object storage has no rename: a checkpoint written again under its own name (a step saved
again at an epoch's end) loses its manifest first, and is complete again only when its new
manifest is in. Each object is checked against the manifest's size after it is uploaded; a
read downloads only the files the manifest lists, into a staging folder renamed into place,
and verifies each (size, SHA-256).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from glassloop.errors import CheckpointError
from glassloop.run_dir.checkpoints import mark, remove_marked
from glassloop.run_dir.layout import BEST, CHECKPOINTS, LATEST, MANIFEST, STEP_DIR
from glassloop.run_dir.manifest import SAFE_NAME, verify_files
from glassloop.storage.atomic import own_dir, refuse_link, remove_tree, replace_own


class FsspecStore:
    """Checkpoints under ``root`` of the fsspec filesystem ``fs``, read into the local folder
    ``local`` (a run directory's local copy); ``shown``: the URL as messages name it
    (secrets replaced); ``bucket``: an object store's bucket (no folders to make there)."""

    def __init__(
        self, fs: Any, root: str, local: Path, *, shown: str, bucket: str | None = None
    ) -> None:
        self.fs, self.root, self.local = fs, root.rstrip("/"), local
        self.shown, self.bucket = shown, bucket

    def where(self, name: str) -> str:
        return f"{self.root}/{BEST}" if name == BEST else f"{self.root}/{CHECKPOINTS}/{name}"

    def local_of(self, name: str) -> Path:
        """Where :meth:`read` puts ``name`` in the local copy."""
        return self.local / BEST if name == BEST else self.local / CHECKPOINTS / name

    def shown_of(self, name: str) -> str:
        """``name`` as messages show it: under the URL (secrets replaced)."""
        return f"{self.shown}/{BEST}" if name == BEST else f"{self.shown}/{CHECKPOINTS}/{name}"

    def write(self, name: str, folder: Path) -> bool:
        """``folder``'s files (the manifest's list) first, each checked against its size, the
        manifest last, read back; then ``latest`` for a step's. ``folder`` replaced meanwhile
        (the same step saved again): abandoned, ``name`` left incomplete (its own write comes)."""
        try:
            manifest = refuse_link(folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            return False  # (swapped for the same step saved again: its own write follows)
        files = json.loads(manifest)["files"]
        where = self.where(name)
        self._refuse_link(where)
        if self.fs.exists(f"{where}/{MANIFEST}"):  # incomplete while its objects change
            self.fs.rm_file(f"{where}/{MANIFEST}")
        try:
            for file, entry in sorted(files.items()):
                refuse_link(folder / file)  # (never read through a link, nor written)
                self._refuse_link(f"{where}/{file}")
                self.makedirs(f"{where}/{file}".rsplit("/", 1)[0])
                self.fs.put_file(str(folder / file), f"{where}/{file}")
                size = self.fs.info(f"{where}/{file}")["size"]
                if size != entry["size"]:
                    raise OSError(f"{file} has {size} bytes after upload, not {entry['size']}")
        except OSError:
            if _replaced(folder, manifest):
                return False
            raise
        if _replaced(folder, manifest):
            return False  # (replaced with files of the same sizes: its own write redoes it)
        self.fs.pipe_file(f"{where}/{MANIFEST}", manifest)
        if self.fs.cat_file(f"{where}/{MANIFEST}") != manifest:
            raise OSError(f"{where}/{MANIFEST} does not read back as written")
        if name != BEST:
            self.fs.pipe_file(f"{self.root}/{CHECKPOINTS}/{LATEST}", (name + "\n").encode())
        return True

    def complete(self) -> list[str]:
        return self.steps(complete=True)

    def steps(self, *, complete: bool) -> list[str]:
        """The ``step-`` folders, oldest first (``complete``: those with a manifest)."""
        try:
            entries = self.fs.ls(f"{self.root}/{CHECKPOINTS}", detail=False)
        except FileNotFoundError:
            return []
        names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in entries})
        steps = [n for n in names if STEP_DIR.match(n)]
        return [n for n in steps if not complete or self.has_manifest(n)]

    def has_manifest(self, name: str) -> bool:
        return bool(self.fs.exists(f"{self.where(name)}/{MANIFEST}"))

    def read(self, name: str) -> Path:
        """The files ``name``'s manifest lists (nothing else), into a staging folder renamed
        to the local copy's ``checkpoints/<name>`` (``best/``), each verified."""
        source = self.where(name)
        target = self.local_of(name)
        self._refuse_link(source)
        try:
            manifest = json.loads(self.fs.cat_file(f"{source}/{MANIFEST}"))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint: '{self.shown_of(name)}' has no manifest") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            raise CheckpointError(f"checkpoint: {self.shown}: {source} has no file list")
        own_dir(target.parent)
        staging = target.with_name(f".tmp-{target.name}-{os.getpid()}")
        if os.path.lexists(staging):
            remove_tree(staging)
        own_dir(staging)
        mark(staging)
        try:
            for file in [*sorted(files), MANIFEST]:
                if not SAFE_NAME.match(file) or ".." in file:
                    raise CheckpointError(f"checkpoint: {source}: the manifest names {file!r}")
                local = staging / file
                own_dir(local.parent)
                self._refuse_link(f"{source}/{file}")
                try:
                    self.fs.get_file(f"{source}/{file}", str(local))
                except FileNotFoundError:
                    raise CheckpointError(
                        f"checkpoint: '{self.shown_of(name)}': {file} is missing"
                    ) from None
        except BaseException:
            remove_marked(staging)
            raise
        if os.path.lexists(target):  # (a local one of the same name, not verifying)
            remove_marked(target)
        replace_own(staging, target)
        try:
            verify_files(target)  # (its message names the checkpoint, not the staging)
        except BaseException:
            remove_marked(target)
            raise
        return target

    def remove(self, name: str) -> None:
        """The manifest first (a kill half-way leaves an incomplete one), then the rest."""
        where = self.where(name)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{where}/{MANIFEST}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(where, recursive=True)

    def makedirs(self, folder: str) -> None:
        """``folder`` made where folders are real (``memory://``, a mounted disk); an object
        store has none, and its driver's makedirs would create a bucket deleted since."""
        if self.bucket is None:
            self.fs.makedirs(folder, exist_ok=True)

    def _refuse_link(self, where: str) -> None:
        """A local filesystem's link where a checkpoint goes (an object store has none)."""
        islink = getattr(self.fs, "islink", None)
        if callable(islink) and islink(where):
            refuse_link(Path(where))  # (raises: its one message)


def _replaced(folder: Path, manifest: bytes) -> bool:
    """Whether the local checkpoint ``folder`` is no longer the one whose manifest was read."""
    try:
        return (folder / MANIFEST).read_bytes() != manifest
    except OSError:
        return True
