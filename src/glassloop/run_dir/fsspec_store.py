"""Any fsspec filesystem (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``) as a
:class:`~glassloop.run_dir.store.CheckpointStore`: a checkpoint is a folder of objects,
``URL/checkpoints/step-XXXXXXXX/`` or ``URL/best/``, complete once its ``manifest.json`` is
there (uploaded last, read back byte for byte; ``latest`` moved after it).

Object storage has no rename: a checkpoint written again under its own name (a step saved
again at an epoch's end) loses its manifest first, and is complete again only when its new
manifest is in. Each object is checked against the manifest's size after it is uploaded; a
read downloads only the files the manifest lists, each first checked against its size there,
into a staging folder renamed into place, and verifies each (size, SHA-256).

Written by a job of a remote run (:mod:`glassloop.run_dir.remote`), every write is fenced:
:attr:`FsspecStore.fence` (the lease's :meth:`~glassloop.run_dir.lease.Lease.check`) comes
first and raises once a newer job has taken the run over; and a name every job writes
(``latest``, run.json, the metrics) is written, where the store has conditional writes
(S3: ``If-Match`` on the ETag read before the fence, ``If-None-Match: *`` for a new one),
only if nobody wrote it since. A job frozen between its fence and its write (``SIGSTOP``, a
paused VM) thus gets at most that one write in after it lost the run, and never one that a
reader takes: each job's record, ``.generations/00000007/record.json`` (only that job writes
it), names the checkpoints the run is made of, each with the generation that wrote it (its
manifest carries it too), and that job's copies of the run's files lie beside it. A reader
takes only what the newest record names (:meth:`FsspecStore.resolve`): a checkpoint folder a
stale job brought back, a manifest it wrote over another's or its late record never are.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glassloop.errors import CheckpointError
from glassloop.run_dir.checkpoints import mark, remove_marked
from glassloop.run_dir.layout import (
    BEST,
    CHECKPOINTS,
    GENERATION_DIR,
    GENERATIONS,
    LATEST,
    MANIFEST,
    RECORD,
    STEP_DIR,
    WEIGHTS,
)
from glassloop.run_dir.manifest import SAFE_NAME, verify_files
from glassloop.storage.atomic import own_dir, refuse_link, remove_tree, replace_own
from glassloop.storage.redaction import printable

MAX_JSON = 16 << 20  # a manifest or a record read from the store (a real one: kilobytes)
MAX_WALK = 64  # records read back past newer ones that are not committed (jobs that died early)


class FsspecStore:
    """Checkpoints under ``root`` of the fsspec filesystem ``fs``, read into the local folder
    ``local`` (a run directory's local copy); ``shown``: the URL as messages name it
    (secrets replaced); ``bucket``: an object store's bucket (no folders to make there)."""

    def __init__(
        self, fs: Any, root: str, local: Path, *, shown: str, bucket: str | None = None
    ) -> None:
        self.fs, self.root, self.local = fs, root.rstrip("/"), local
        self.shown, self.bucket = shown, bucket
        # The writing job's (set by its lease, glassloop.run_dir.lease): the check before each
        # write, which raises once a newer job took the run over, and its generation (0: none).
        self.fence: Callable[[], None] = lambda: None
        self.generation = 0
        self.owner: dict[str, Any] = {}  # (its host and PID, in its record)
        # The run's checkpoints as its newest record names them (name: the generation that
        # wrote it), best/'s writer, and where the run's files are read; None: a run without
        # records (written before generations), whose listing and top-level files are read.
        self.listed: dict[str, int] | None = None
        self.best: int | None = None
        self.files = self.root
        self.conditional = "s3" in _protocols(fs)  # (S3's If-Match / If-None-Match)
        self.etags: dict[str, str] = {}  # what this job last saw of each name it shares

    def where(self, name: str) -> str:
        return f"{self.root}/{BEST}" if name == BEST else f"{self.root}/{CHECKPOINTS}/{name}"

    def local_of(self, name: str) -> Path:
        """Where :meth:`read` puts ``name`` in the local copy."""
        return self.local / BEST if name == BEST else self.local / CHECKPOINTS / name

    def shown_of(self, name: str) -> str:
        """``name`` as messages show it: under the URL (secrets replaced)."""
        return f"{self.shown}/{BEST}" if name == BEST else f"{self.shown}/{CHECKPOINTS}/{name}"

    def generation_dir(self, generation: int) -> str:
        return f"{self.root}/{GENERATIONS}/{generation:08d}"

    def run_file(self, name: str) -> str:
        """Where the run's file ``name`` is read: the record's generation's copy (the final
        weights: at the top, large and written once at the end)."""
        return f"{self.root}/{name}" if name == WEIGHTS else f"{self.files}/{name}"

    def write(self, name: str, folder: Path) -> bool:
        """``folder``'s files (the manifest's list) first, each checked against its size, the
        manifest last (stamped with the writer's generation), read back; then the record names
        it, then ``latest`` for a step's. ``folder`` replaced meanwhile (the same step saved
        again): abandoned, ``name`` left incomplete (its own write comes)."""
        try:
            manifest = refuse_link(folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            return False  # (swapped for the same step saved again: its own write follows)
        files = json.loads(manifest)["files"]
        where = self.where(name)
        self._refuse_link(where)
        if self.fs.exists(f"{where}/{MANIFEST}"):  # incomplete while its objects change
            self.fence()
            self.fs.rm_file(f"{where}/{MANIFEST}")
        try:
            for file, entry in sorted(files.items()):
                refuse_link(folder / file)  # (never read through a link, nor written)
                self._refuse_link(f"{where}/{file}")
                self.makedirs(f"{where}/{file}".rsplit("/", 1)[0])
                self.put(f"{where}/{file}", folder / file)
                size = self.fs.info(f"{where}/{file}")["size"]
                if size != entry["size"]:
                    raise OSError(f"{file} has {size} bytes after upload, not {entry['size']}")
        except OSError:
            if _replaced(folder, manifest):
                return False
            raise
        if _replaced(folder, manifest):
            return False  # (replaced with files of the same sizes: its own write redoes it)
        if self.generation:  # (a manifest another job wrote over this one names another)
            stamped = {**json.loads(manifest), "generation": self.generation}
            manifest = json.dumps(stamped, indent=1).encode("utf-8")
        self.put(f"{where}/{MANIFEST}", manifest)
        if self.fs.cat_file(f"{where}/{MANIFEST}") != manifest:
            raise OSError(f"{where}/{MANIFEST} does not read back as written")
        if self.generation:  # the record names it before `latest` does
            if name == BEST:
                self.best = self.generation
            else:
                self.listed = {**(self.listed or {}), name: self.generation}
            self.commit()
        if name != BEST:
            latest = f"{self.root}/{CHECKPOINTS}/{LATEST}"
            self.put(latest, (name + "\n").encode(), shared=True)
        return True

    def put(self, path: str, data: bytes | Path, *, shared: bool = False) -> None:
        """One object written (``data``, or the local file it names), fenced: :attr:`fence`
        first. ``shared``: a name every job of the run writes; where the store has
        conditional writes, written only if it is still what this job saw before its fence
        (another job's write since: read again, fenced again), so that a job that stalled
        between its fence and its write, and was taken over meanwhile, is refused by the store."""
        for _ in range(3):
            match = self._match(path) if shared and self.conditional else {}
            self.fence()
            try:
                if isinstance(data, Path):
                    self.fs.put_file(str(data), path)
                    return
                done = self.fs.pipe_file(path, data, **match)
            except OSError as err:
                if not match or not _refused(err):
                    raise
                self.etags.pop(path, None)
                # (an S3-compatible store without conditional writes: plain ones from now on)
                self.conditional = getattr(err, "errno", None) != errno.ENOSYS
                continue
            if match and isinstance(done, dict) and done.get("ETag"):
                self.etags[path] = str(done["ETag"])
            return
        raise OSError(f"{path} was written by another job each time this one tried")

    def _match(self, path: str) -> dict[str, str]:
        """The condition of a shared write: the ETag this job last saw of ``path`` (read now
        when it has none: before the fence, so a newer job's write after it changes it)."""
        if path in self.etags:
            return {"IfMatch": self.etags[path]}
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(path)
        try:
            return {"IfMatch": str(self.fs.info(path)["ETag"])}
        except FileNotFoundError:
            return {"IfNoneMatch": "*"}

    # ------------------------------------------------------------------------- records
    def resolve(self, below: int | None = None) -> int:
        """Read the run's newest committed record (of a generation older than ``below``: a
        writer's own, not yet committed): :meth:`complete` then lists the checkpoints it
        names, and the run's files are read from its generation's folder. Its generation; 0
        for a run without records (its listing and its top-level files, as before them)."""
        found = [g for g in generations(self.fs, self.root) if below is None or g < below]
        for walked, generation in enumerate(reversed(found)):
            record = self._record(generation)
            if record is not None:
                self.listed, self.best = dict(record["checkpoints"]), record["best"]
                self.files = self.generation_dir(generation)
                return generation
            if walked >= MAX_WALK:
                raise CheckpointError(
                    f"checkpoint: {self.shown}: none of its newest {MAX_WALK} generations has a "
                    "readable record (jobs that all ended before their first write?); nothing "
                    "was changed: copy the checkpoint you want to a new URL and resume there"
                )
        self.listed, self.best, self.files = None, None, self.root
        return 0

    def _record(self, generation: int) -> dict[str, Any] | None:
        """Generation ``generation``'s record, when it is a committed one that makes sense
        (a job that died before its first write left only its owner there: ``None``)."""
        try:
            record = self.read_json(f"{self.generation_dir(generation)}/{RECORD}", MAX_JSON)
        except (FileNotFoundError, ValueError, RecursionError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("checkpoints"), dict):
            return None
        named = record["checkpoints"]
        fits = all(STEP_DIR.match(str(n)) and _generation(g, generation) for n, g in named.items())
        best = record.get("best")
        return record if fits and (best is None or _generation(best, generation)) else None

    def read_json(self, path: str, limit: int) -> Any:
        """The JSON object at ``path``, refused (``ValueError``) when larger than ``limit``
        bytes: its size is asked before anything is read."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(path)
        size = self.fs.info(path)["size"]
        if not isinstance(size, int) or size > limit:
            raise ValueError(f"{path.rsplit('/', 1)[-1]} has {size} bytes (at most {limit})")
        return json.loads(self.fs.cat_file(path))

    def adopt(self, base: str | None, *, best: bool) -> None:
        """A writer's record begins with what it pulled: ``base``, the checkpoint it resumes
        from, and those before it the record it read names (a run without records: every
        complete one); ``best``: its best/ too. What it passed over is not the run's any more."""
        listed = self.listed if self.listed is not None else dict.fromkeys(self.complete(), 0)
        self.listed = {n: g for n, g in listed.items() if base is not None and n <= base}
        self.best = (self.best or 0) if best else None

    def commit(self) -> None:
        """This job's record as it is now (only this job writes it; a reader takes it once a
        newer job's exists no more)."""
        record = {**self.owner, "generation": self.generation, "best": self.best}
        record["checkpoints"] = dict(sorted((self.listed or {}).items()))
        self.put(f"{self.generation_dir(self.generation)}/{RECORD}", json.dumps(record).encode())

    def complete(self) -> list[str]:
        return self.steps(complete=True)

    def steps(self, *, complete: bool) -> list[str]:
        """The ``step-`` folders, oldest first (``complete``: those with a manifest that the
        record names, with a record).
        """
        if complete and self.listed is not None:
            return [n for n in sorted(self.listed) if self.has_manifest(n)]
        try:
            entries = self.fs.ls(f"{self.root}/{CHECKPOINTS}", detail=False)
        except FileNotFoundError:
            return []
        names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in entries})
        steps = [n for n in names if STEP_DIR.match(n)]
        return [n for n in steps if not complete or self.has_manifest(n)]

    def has_manifest(self, name: str) -> bool:
        return bool(self.fs.exists(f"{self.where(name)}/{MANIFEST}"))

    def has_best(self) -> bool:
        """A best/ the record names (without a record: any complete one)."""
        return (self.listed is None or self.best is not None) and self.has_manifest(BEST)

    def read(self, name: str) -> Path:
        """The files ``name``'s manifest lists (nothing else), each of the manifest's size in
        the store before it is downloaded, into a staging folder renamed to the local copy's
        ``checkpoints/<name>`` (``best/``), each verified. With a record: refused unless its
        manifest is of the generation the record names for it."""
        source = self.where(name)
        target = self.local_of(name)
        self._refuse_link(source)
        try:
            manifest = self.read_json(f"{source}/{MANIFEST}", MAX_JSON)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint: '{self.shown_of(name)}' has no manifest") from None
        except (ValueError, RecursionError) as err:  # (cut by a kill, or planted)
            raise CheckpointError(
                f"checkpoint: '{self.shown_of(name)}': its manifest cannot be read ({err})"
            ) from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            raise CheckpointError(f"checkpoint: {self.shown}: {source} has no file list")
        expected = self.best if name == BEST else (self.listed or {}).get(name)
        if self.listed is not None and manifest.get("generation", 0) != expected:
            raise CheckpointError(
                f"checkpoint: '{self.shown_of(name)}' was written by a job that had lost the "
                f"run (generation {printable(manifest.get('generation', 0), 20)}; the run's record "
                f"names {expected}): not the run's"
            )
        own_dir(target.parent)
        staging = target.with_name(f".tmp-{target.name}-{os.getpid()}")
        if os.path.lexists(staging):
            remove_tree(staging)
        own_dir(staging)
        mark(staging)
        try:
            for file in sorted(files):
                if not SAFE_NAME.match(file) or ".." in file:
                    raise CheckpointError(f"checkpoint: {source}: the manifest names {file!r}")
                local = staging / file
                own_dir(local.parent)
                self._refuse_link(f"{source}/{file}")
                self._download(name, file, files[file], local)
            (staging / MANIFEST).write_bytes(json.dumps(manifest).encode("utf-8"))
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

    def _download(self, name: str, file: str, entry: Any, local: Path) -> None:
        """``file`` of ``name`` into ``local``, once its size in the store is the manifest's
        (a 300 MB object where the manifest says 1.2 MB is never downloaded)."""
        source = f"{self.where(name)}/{file}"
        wanted = entry.get("size") if isinstance(entry, dict) else None
        try:
            size = self.fs.info(source)["size"]
            if size != wanted or not isinstance(wanted, int):
                raise CheckpointError(
                    f"checkpoint: '{self.shown_of(name)}': {file} has {size} bytes, the "
                    f"manifest says {printable(wanted, 20)} (truncated or replaced)"
                )
            self.fs.get_file(source, str(local))
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint: '{self.shown_of(name)}': {file} is missing"
            ) from None

    def remove(self, name: str) -> None:
        """The record first (it names it no more), then the manifest (a kill half-way leaves
        an incomplete one), then the rest."""
        if self.generation and name in (self.listed or {}):
            self.listed = {n: g for n, g in (self.listed or {}).items() if n != name}
            self.commit()
        where = self.where(name)
        for path, recursive in ((f"{where}/{MANIFEST}", False), (where, True)):
            self.fence()
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=recursive)

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


def generations(fs: Any, root: str) -> list[int]:
    """The generations of the run at ``root`` (``.generations/00000007``...), oldest first."""
    folder = f"{root}/{GENERATIONS}"
    with contextlib.suppress(AttributeError):
        fs.invalidate_cache(folder)
    try:
        entries = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in entries}
    return sorted(int(n) for n in names if GENERATION_DIR.match(n))


def _generation(value: Any, newest: int) -> bool:
    """A record's generation of a checkpoint: a whole number, at most its own."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= newest


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _refused(err: BaseException) -> bool:
    """Whether a conditional write was refused: the name was written since its ETag was read
    (HTTP 412, or 409 for one in flight), created meanwhile or removed; or the store has no
    conditional writes (501)."""
    if isinstance(err, (FileExistsError, FileNotFoundError)):
        return True
    cause: BaseException | None = err
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return status in (409, 412, 501)
        cause = cause.__cause__
    return False
