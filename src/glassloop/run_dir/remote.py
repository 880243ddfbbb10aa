"""Run directories on object storage (``run_dir="s3://bucket/run"``, ``gs://``, ``az://``,
``memory://``: any fsspec filesystem).

The run works in a local copy of the run directory and this module mirrors it to the remote
one; the remote one *is* the run: a resume reads it, whichever machine it starts on.

Why a local copy and not writes straight to the bucket: every guarantee glassloop gives on a
disk (atomic renames, fsync, link safety, the lock, a checkpoint visible only once complete)
keeps holding, unchanged, where it is written; object storage has no rename, and no step
ever waits for the network. Uploads run in a thread, in order, one at a time.

What the remote run holds, and when it is visible (objects first, the manifest last, ``latest``
only after the manifest reads back byte for byte)::

    URL/checkpoints/step-00000120/...   every file of a committed local checkpoint, each
                                        checked against its manifest's size after upload
    URL/checkpoints/step-00000120/manifest.json   uploaded last: the checkpoint is complete
    URL/checkpoints/latest              moved after the manifest read back
    URL/best/ ...                       the same way (its manifest last)
    URL/config.json, metrics.csv, metrics.jsonl, run.json
                                        with each checkpoint, before its manifest
    URL/model.safetensors, report/, then run.json   at the end
    URL/.lease.json, URL/.generations/00000007/     who writes the run, and what it is made of

A resume rebuilds the local copy from the bucket (the bucket is the run; the local copy is
glassloop's cache of it): the newest remote checkpoint whose manifest exists and whose every
file verifies (size and SHA-256, :func:`glassloop.run_dir.manifest.verify_files`), then the run's
files; a checkpoint cut short by a kill (no manifest), damaged or missing an object is
skipped, with a line; a bucket that cannot be read is an error, never a fresh start. Pruning
keeps the newest ``keep_last`` complete checkpoints (at least two) and the one ``latest``
names; a pruned checkpoint loses its manifest first, so a kill half-way never leaves one that
looks whole; so does a step saved again (an epoch's end) before it is uploaded again.

Every write is fenced by the job's generation (:mod:`glassloop.run_dir.lease`): a job that
stalled and was taken over writes nothing a reader takes. Each job's record names the
checkpoints the run is made of and holds that job's copies of the run's files; a pull reads
through the newest one (:mod:`glassloop.run_dir.fsspec_store`), and a writer starts its own
from what it pulled before it writes anything else.

Credentials come from the filesystem's own sources (environment variables, profiles, instance
metadata) and are never written anywhere by glassloop; the URL is recorded with any secret in it
replaced (:mod:`glassloop.storage.redaction`). One job writes a remote run at a time: a lease
object in the store (:mod:`glassloop.run_dir.lease`) refuses a second one, on any machine."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from glassloop.errors import CheckpointError, CheckpointWriteError, GlassloopError
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import MARKER, mark, remove_marked
from glassloop.run_dir.fsspec_store import FsspecStore
from glassloop.run_dir.layout import (
    BEST,
    CHECKPOINTS,
    LATEST,
    RUN_FILES,
    RUN_FOLDERS,
    WEIGHTS,
)
from glassloop.run_dir.lease import EXPIRES_S, Lease
from glassloop.run_dir.lock import RunLock
from glassloop.storage.atomic import atomic_path, own_dir, remove_tree
from glassloop.storage.cache import cache_dir
from glassloop.storage.file_names import is_url
from glassloop.storage.redaction import redacted, remember_secrets

CHUNK = 8 << 20
# A resume's test of a downloaded checkpoint (raises CheckpointError when it is not one to
# resume from: Checkpointer.usable).
Usable = Callable[[Path], None]


def local_copy_root() -> Path:
    """Where the local copies of remote runs are kept: ``remote-runs`` in glassloop's cache
    (``$GLASSLOOP_CACHE_DIR``, default ``~/.cache/glassloop``)."""
    return cache_dir() / "remote-runs"


def open_run_dir(run_dir: str | Path | None) -> tuple[Path | None, RemoteRun | None]:
    """The local directory a run writes in, and its remote mirror when ``run_dir`` is a URL.

    >>> open_run_dir("runs/x")
    (PosixPath('runs/x'), None)
    """
    if run_dir is None:
        return None, None
    if str(run_dir).startswith("file://"):
        return Path(str(run_dir)[len("file://") :]), None
    if not is_url(run_dir):
        return Path(run_dir), None
    remote = RemoteRun(str(run_dir))
    return remote.local, remote


class RemoteRun:
    """The remote copy of a run directory (see the module docstring): :meth:`held` around a
    run (the local copy locked and pulled), :meth:`push_checkpoint` after each commit,
    :meth:`push_run_files` and :meth:`close` at the end."""

    def __init__(self, url: str, local: Path | None = None, *, copies: Path | None = None) -> None:
        try:
            import fsspec  # (the optional extra: glassloop[cloud])
        except ImportError as err:
            raise GlassloopError(
                f"run: run_dir {redacted(url)!r} is on a remote filesystem, which needs "
                "fsspec and its driver: pip install 'glassloop[cloud]' (s3fs; gcsfs for gs://, "
                "adlfs for az://)"
            ) from err
        remember_secrets(url)  # (a driver's own message may quote them: never printed)
        self.url = url.rstrip("/")
        self.shown = redacted(self.url)  # (never a secret on screen or on disk)
        if urlsplit(self.url).query or urlsplit(self.url).fragment:
            raise GlassloopError(
                f"run: run_dir {self.shown!r} has a query ('?...') or a fragment ('#...'), "
                "which would become part of every object's name in the store; give the URL "
                "without it and credentials through the driver's own sources (environment "
                "variables such as AWS_ACCESS_KEY_ID, a profile)"
            )
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as err:
            raise GlassloopError(
                f"run: cannot open {self.shown}: {self.scrub(err)} (the driver for this "
                "scheme is missing? s3:// needs s3fs, gs:// gcsfs, az:// adlfs)"
            ) from None  # (the driver's own error may hold what scrub removed)
        self.root = self.root.rstrip("/")
        # An object store's bucket (s3fs, gcsfs and adlfs split a path into one): it must
        # exist, since its driver would create a mistyped one and train into it.
        split = getattr(self.fs, "split_path", None)
        self.bucket: str | None = str(split(self.root)[0]) if callable(split) else None
        digest = hashlib.sha256(self.url.encode("utf-8")).hexdigest()[:16]
        # The local copy: RUN inside a folder of glassloop's that holds the lock, so a pull
        # can fill RUN while no other process on this machine uses it.
        # (``copies``: where they are kept, glassloop's cache by default: local_copy_root())
        self.container = local if local is not None else (copies or local_copy_root()) / digest
        self.local = self.container / "run"
        # Its checkpoints (glassloop.run_dir.store's guarantees), read into the local copy.
        self.store = FsspecStore(
            self.fs, self.root, self.local, shown=self.shown, bucket=self.bucket
        )
        self.keep_last = 0  # (set by the checkpointer: what pruning keeps)
        self.say: Callable[[str], None] = print
        self.lock = threading.Lock()  # the upload's choice of checkpoint against local pruning
        self.uploading: Path | None = None  # never pruned locally while it is uploaded
        self._jobs: queue.Queue[tuple[str, Path] | None] = queue.Queue()
        self._failure: Exception | None = None
        self._worker: threading.Thread | None = None
        self._said_skip = False
        self.lease: Lease | None = None  # this job's, while it writes (held)
        self._said_lost = False

    # ------------------------------------------------------------------------- paths
    def remote(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def scrub(self, err: BaseException | str, limit: int = 300) -> str:
        """An error's text with the remote path as shown and every secret replaced (a
        driver quotes what it was handed, ``TOKEN@bucket`` or ``key:secret@bucket``: the
        URL's secrets are remembered, :func:`glassloop.storage.redaction.remember_secrets`)."""
        text = str(err).replace(self.url, self.shown).replace(str(self.local), self.shown)
        text = re.sub(r"[^\s/@'\"]+:[^\s/@'\"]+@", "***@", text)  # (user:password@, bare)
        return str(redacted(text))[:limit]

    def check_bucket(self) -> None:
        """An object store's bucket that does not exist (or that these credentials cannot
        see) is one line: never created, never a fresh run in a mistyped name."""
        if self.bucket is not None and not self.fs.exists(self.bucket):
            raise GlassloopError(
                f"run: the bucket {redacted(self.bucket)!r} of {self.shown} does not exist (or "
                "these credentials cannot see it); glassloop never creates one: create it "
                "(e.g. aws s3 mb s3://BUCKET) or correct the URL"
            )

    # ------------------------------------------------------------------------- pull
    @contextlib.contextmanager
    def held(self, usable: Usable | None = None, *, writes: bool = True) -> Iterator[str | None]:
        """Hold the local copy (one process on this machine) and, for a job that ``writes``,
        the run's lease in the store (one job per URL: :mod:`glassloop.run_dir.lease`);
        :meth:`pull` into it, and at the end wait for every upload (its failure, if the run
        did not raise one: a warning while another error is on its way out, see
        :meth:`close`) and give the lease back; yield what was pulled."""
        if os.path.lexists(self.container) and not (
            self.container.is_dir()
            and not self.container.is_symlink()
            and (self.container / MARKER).is_file()
        ):
            raise GlassloopError(
                f"run: the local copy of {self.shown}, '{self.container}', exists and is not "
                "glassloop's; move it away (or set GLASSLOOP_CACHE_DIR elsewhere)"
            )
        own_dir(self.container)
        mark(self.container)
        lock = RunLock(self.container)
        lock.acquire()
        try:
            if writes:
                self._take_lease()
            pulled = self.pull(usable)
            if writes:
                self._adopt(pulled)
            yield pulled
        except GlassloopError as err:  # its lines name the run, not glassloop's cache
            err.args = (self.scrub(err, limit=100_000), *err.args[1:])
            raise
        finally:
            try:
                self.close(quiet=True)  # (the normal end closed it already, raising)
            finally:
                try:
                    self._give_lease_back()
                finally:
                    lock.release()

    def _take_lease(self) -> None:
        """This job's lease on the URL, before anything is read or written there."""
        self.lease = Lease(self.store, self.shown)
        self.lease.say = self.say
        try:
            self.check_bucket()
            self.store.makedirs(self.root)  # (a filesystem with real folders: the lease's)
            self.lease.acquire()
        except GlassloopError:
            self.lease = None
            raise
        except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
            self.lease = None
            raise CheckpointError(
                f"checkpoint: cannot take the lease of {self.shown}: {self.scrub(err)}; "
                "nothing was changed (check the network and the credentials, then run again)"
            ) from None

    def _give_lease_back(self) -> None:
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            lease.release()
        except Exception as err:  # (the next job then waits for its expiry: said)
            self.say(
                f"warning: could not give back the lease of {self.shown} ({self.scrub(err)}); "
                f"the next job on it waits up to {EXPIRES_S:.0f} s"
            )

    def pull(self, usable: Usable | None = None) -> str | None:
        """Make the local copy the remote run: a fresh folder (the previous local copy,
        glassloop's own cache, removed: the bucket is the run, and a checkpoint a kill kept
        from reaching it is lost as the machine's disk would be) with the newest remote
        checkpoint whose every file verifies and that ``usable`` takes (the resume's own
        test: its state and weights, :meth:`glassloop.checkpoint.checkpointer.Checkpointer.usable`),
        then the run's files and a ``best/`` that verifies; the checkpoint's name, or
        ``None`` (a bucket without checkpoints).

        A bucket that cannot be read is an error, never a fresh start; remote checkpoints
        that all fail to verify are one error naming each (nothing is changed in the bucket
        either way). Read through the run's newest record (a writer's own, not yet one, aside)."""
        self._fresh_local()
        try:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache()  # (another process may have written since)
            self.check_bucket()
            self.store.resolve(below=self.lease.generation if self.lease else None)
            there = self.store.complete()
            found, problems = self._download_newest(there, usable=usable)
            if there and found is None:
                raise CheckpointError(
                    f"checkpoint: no valid checkpoint to resume in {self.shown} (nothing was "
                    f"changed): {' | '.join(problems)}"
                )
            for name in RUN_FILES:
                self.download(self.store.run_file(name), self.local / name)
            if self.store.has_best():
                self._download_newest([BEST])
        except GlassloopError:
            raise
        except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
            raise CheckpointError(
                f"checkpoint: cannot read the remote run {self.shown}: {self.scrub(err)}; "
                "nothing was changed (check the network and the credentials, then run again)"
            ) from None  # (the driver's own error may hold what scrub removed)
        return found

    def _adopt(self, pulled: str | None) -> None:
        """This job's record, before it writes anything else: the checkpoint it pulled and
        those before it, and its own copies of the run's files it pulled (what a reader takes
        from now on, whatever a job it took over still writes)."""
        try:
            self.store.adopt(pulled, best=(self.local / BEST).is_dir())
            for name in RUN_FILES:
                if name != WEIGHTS and (self.local / name).is_file():
                    own = f"{self.store.generation_dir(self.store.generation)}/{name}"
                    self.store.put(own, (self.local / name).read_bytes())
            self.store.commit()
        except GlassloopError:
            raise
        except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
            raise CheckpointError(
                f"checkpoint: cannot write the remote run {self.shown}: {self.scrub(err)}; "
                "nothing of it was changed (check the network and the credentials, then run "
                "again)"
            ) from None

    def _fresh_local(self) -> None:
        """An empty local copy (the previous one, inside glassloop's own marked folder, is
        removed: never through a link)."""
        if os.path.lexists(self.local):
            remove_tree(self.local)
        own_dir(self.local)

    def _download_newest(
        self, names: list[str], *, usable: Usable | None = None
    ) -> tuple[str | None, list[str]]:
        """The newest of the remote checkpoints ``names`` whose files verify and that
        ``usable`` takes, read into the local copy (a missing object, a bad manifest, a
        failed check: the next older one, with a line); what failed, each."""
        problems = []
        # (not OSError: a store that cannot be read is an error, never a fall back)
        failed = (
            CheckpointError,
            ValueError,
            KeyError,
            TypeError,
            FileNotFoundError,
            RecursionError,
        )
        for name in reversed(names):
            into = self.store.local_of(name)
            try:
                self.store.read(name)
                if usable is not None:
                    usable(into)
            except failed as err:  # (a manifest nested 200,000 deep: RecursionError)
                problem = self.scrub(err)
                self.say(f"warning: {problem} (after download); falling back to an older one")
                problems.append(problem)
                if os.path.lexists(into):
                    remove_marked(into)
                continue
            if name != BEST:
                with atomic_path(self.local / CHECKPOINTS / LATEST) as tmp:
                    tmp.write_text(name + "\n", encoding="utf-8")
            return name, problems
        return None, problems

    def download(self, source: str, target: Path) -> None:
        """``source`` into ``target`` through a temporary file beside it (never a link)."""
        if not self.fs.exists(source):
            return
        with atomic_path(target) as tmp:
            self.fs.get_file(source, str(tmp))

    # ------------------------------------------------------------------------- push
    def push_checkpoint(self, path: Path) -> None:
        """Upload a committed local checkpoint (``checkpoints/step-*`` or ``best``) and the
        run's files, in the background, after those queued before."""
        self._enqueue("checkpoint", path)

    def push_run_files(self) -> None:
        """Upload the run's files (metrics, run.json, the final weights, the report)."""
        self._enqueue("files", self.local)

    def _enqueue(self, kind: str, path: Path) -> None:
        if self._worker is None:
            # A daemon: an interpreter that exits on an error it did not expect does not
            # wait for uploads (what is in the bucket stays consistent: manifests last).
            self._worker = threading.Thread(target=self._work, name="glassloop-upload")
            self._worker.daemon = True
            self._worker.start()
        self._jobs.put((kind, path))

    @contextlib.contextmanager
    def protected(self) -> Iterator[Path | None]:
        """The checkpoint being uploaded (local pruning keeps it) while the caller prunes."""
        with self.lock:
            yield self.uploading

    def close(self, *, quiet: bool = False) -> None:
        """Wait until every queued upload is done; raise the first failure (``quiet``: say
        it as a warning instead)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        failure = self.failure()
        if failure is not None and quiet:
            self.say(f"warning: {failure}")
        elif failure is not None:
            raise failure

    def failure(self) -> Exception | None:
        """The first failed upload's error, once, or a lost lease's (``None``: none so far)."""
        failure, self._failure = self._failure, None
        if failure is None and self.lease is not None and not self._said_lost:
            failure = self.lease.lost()
            self._said_lost = failure is not None
        return failure

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._failure is not None or (self.lease and self.lease.lost()):
                continue  # (reported once; what follows it waits for the next run)
            kind, path = job
            try:
                if kind == "checkpoint":
                    self._upload_newest(path)  # (the run's files with it)
                else:
                    self._upload_run_files()
            except Exception as err:  # handed to the training thread (failure)
                if self.lease is not None and self.lease.lost() is not None:
                    continue  # (taken over: failure() says so)
                self._failure = CheckpointWriteError(
                    f"checkpoint: uploading to {self.shown} failed: {self.scrub(err)}; the "
                    "checkpoints uploaded before are intact, a resume starts from them"
                )

    def _upload_newest(self, path: Path) -> None:
        """Upload ``path`` unless a newer step's checkpoint is queued behind it (saves come
        faster than uploads: the remote gets the newest, said once) or it was pruned."""
        later = [job for job in list(self._jobs.queue) if job is not None]
        if path.name != BEST and any(k == "checkpoint" and p.name != BEST for k, p in later):
            if not self._said_skip:
                self._said_skip = True
                self.say(
                    f"checkpoint: uploads to {self.shown} are slower than the saves; the "
                    "newest checkpoint is uploaded each time, the ones between are skipped"
                )
            return
        with self.lock:  # (chosen and protected from local pruning in one step)
            if not (path / layout.MANIFEST).is_file():
                return
            self.uploading = path
        try:
            self._upload_checkpoint(path)
        finally:
            self.uploading = None

    def _upload_checkpoint(self, path: Path) -> None:
        """The run's files as they are now (a resume from this checkpoint finds the metric
        rows up to its step in the bucket), then the checkpoint, complete once its manifest
        is in (:meth:`glassloop.run_dir.fsspec_store.FsspecStore.write`); then pruning."""
        if path.name != BEST:
            self._upload_run_files(final=False)
        if self.store.write(path.name, path) and path.name != BEST:
            self._prune(path.name)

    def _prune(self, latest: str) -> None:
        """Keep the newest ``keep_last`` complete remote checkpoints (two at least: a step
        saved again, as at an epoch's end, loses its manifest while it is uploaded again, and
        a kill then must find another complete one) and ``latest``; remove the others and any
        incomplete one older than ``latest`` (a kill's leftovers), each manifest first."""
        if self.keep_last < 1:
            return
        complete = self.store.complete()
        kept = set(complete[-max(self.keep_last, 2) :])
        for name in self.store.steps(complete=False):
            if name not in kept and name < latest:
                self.store.remove(name)

    def _upload_run_files(self, *, final: bool = True) -> None:
        """The run's files as they are now: read whole first (the metric files grow while
        training goes on; an upload of a growing file would not match its length); the
        report's files but the temporary ones of a report being drawn. Not ``final`` (with a
        checkpoint): never the final weights nor a run.json that says the run finished,
        which training may have written while this checkpoint's upload waited its turn:
        the bucket says "finished" only after its final checkpoint (the end's own upload)."""
        self.store.makedirs(self.root)
        for folder in RUN_FOLDERS:
            if (self.local / folder).is_symlink() or not (self.local / folder).is_dir():
                continue
            for file in sorted((self.local / folder).glob("[!.]*")):
                if file.is_file() and not file.is_symlink():
                    self.store.makedirs(self.remote(folder))
                    try:
                        data = file.read_bytes()
                    except FileNotFoundError:  # (replaced meanwhile)
                        continue
                    self.store.put(self.remote(folder, file.name), data, shared=True)
        for name in RUN_FILES:
            file = self.local / name
            if not file.is_file() or file.is_symlink():
                continue
            if name == WEIGHTS:  # (large; replaced only by a rename, never rewritten)
                if final:
                    self.store.put(self.remote(name), file)
                continue
            data = file.read_bytes()
            if not final and name == layout.STATUS and _says_finished(data):
                continue
            if self.store.generation:  # this job's copy (what a reader takes), then the top's
                own = self.store.generation_dir(self.store.generation)
                self.store.put(f"{own}/{name}", data)
            self.store.put(self.remote(name), data, shared=True)

    def shown_path(self, path: Path) -> str:
        """``path`` of the local copy as the remote run's URL (secrets replaced)."""
        try:
            return f"{self.shown}/{path.relative_to(self.local).as_posix()}"
        except ValueError:
            return str(path)

    def state_info(self) -> dict[str, Any]:
        """What run.json says of it: the URL (secrets replaced) and the local copy."""
        return {"remote": self.shown, "local_copy": str(self.local)}


def _says_finished(data: bytes) -> bool:
    """Whether run.json's bytes say the run finished (unreadable: no)."""
    try:
        return bool(json.loads(data).get("status") == "finished")
    except (ValueError, AttributeError):
        return False
