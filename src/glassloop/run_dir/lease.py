"""One writer per URL: a lease object in the store, so that a second job training into the
same ``s3://...`` run is refused while the first lives, and takes over once the first is gone;
and a generation per job, so that a job that lost the run writes nothing a reader takes.

A machine's lock (:mod:`glassloop.run_dir.lock`) cannot see a job on another machine: the
store itself holds who writes. ```URL/.lease.json`` names its owner (host, PID, a token of its
own) and the time of its last heartbeat; the owner rewrites it every :data:`HEARTBEAT_S`
seconds from a thread and removes it when the run ends (a stop signal's included). A lease
whose heartbeat is older than :data:`EXPIRES_S` belongs to a job that died (``kill -9``, a lost
node): the next job takes it over and says whose it was. So a requeued job waits at most
``EXPIRES_S`` after a crash, and is told how long; on the machine the dead job ran on (its PID
gone) it takes the run over at once.

Taking a lease is the store's exclusive create (``pipe_file(mode="create")``: S3's
``If-None-Match: *``, a local or in-memory filesystem's own): of two jobs starting at once, one
wins and the other is refused. A takeover removes the dead lease first, then creates its own
the same way.

A job that only stalled (``SIGSTOP``, a paused VM, a long swap) may wake after another took
its run over, in the middle of a write. So each job that takes the lease also takes a
generation, one more than the newest, by creating ``URL/.generations/00000007/record.json``
with the same exclusive create (two jobs never hold one: the fencing token). Before each of
its writes a job checks that no newer generation exists (:meth:`Lease.check`, one listing);
once one does, the job has lost the run: it stops at its next step row and writes nothing more.
A write already past that check when the job froze still lands; what keeps it from being
read is :mod:`glassloop.run_dir.fsspec_store`'s (conditional writes, and records naming what
the run is made of). Heartbeat times are wall-clock seconds: the machines' clocks are taken
to agree to within a few seconds, far less than :data:`EXPIRES_S`; a heartbeat further in
the future than that, or a lease that cannot be read (damaged, over :data:`MAX_LEASE` bytes,
nested too deep), is no live job's: taken over, and said so."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from glassloop.errors import CheckpointWriteError, GlassloopError
from glassloop.run_dir.fsspec_store import FsspecStore, generations
from glassloop.run_dir.layout import LEASE, RECORD
from glassloop.storage.redaction import printable

HEARTBEAT_S = 10.0  # how often the owner rewrites its lease
EXPIRES_S = 30.0  # a lease this much older than its heartbeat is a dead job's
LAST_GENERATION = 99_999_999  # (eight digits)
MAX_LEASE = 64 << 10  # a lease or a generation's owner read back (a real one: 100 bytes)


class RunLeased(GlassloopError):
    """Another job holds the run's lease."""


class Lease:
    """``URL/.lease.json`` of the remote run kept in ``store`` (see the module docstring):
    :meth:`acquire` before the first write (the lease, then a generation: the store's writes
    are fenced by :meth:`check` from then on), :meth:`release` at the end; :meth:`lost` is
    the error once another job has taken the run over (``None`` while it is this job's)."""

    def __init__(self, store: FsspecStore, shown: str) -> None:
        self.store, self.fs, self.shown = store, store.fs, shown
        self.path = f"{store.root}/{LEASE}"
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
        self.generation = 0  # this job's, once acquired
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: Exception | None = None
        self.say: Any = print

    def acquire(self) -> None:
        """Take the lease, or raise :class:`RunLeased` naming the job that holds it and how
        long until it expires if that job is dead; then this job's generation."""
        held = self._read()
        if held is not None:
            beat = _heartbeat(held.get("heartbeat"))
            age = time.time() - beat if beat is not None else math.inf
            gone = held.get("host") == self.mine["host"] and not _alive(held.get("pid"))
            if -EXPIRES_S <= age < EXPIRES_S and not gone:  # (clocks a few seconds apart)
                raise RunLeased(
                    f"run: {self.shown} is being written by another job ({_owner(held)}, last "
                    f"heartbeat {max(age, 0):.0f} s ago); two jobs must not train into one URL. "
                    f"Wait for it to end; if it is dead, its lease expires in "
                    f"{EXPIRES_S - age:.0f} s and the same command then takes the run over"
                )
            if gone:
                why = "its process is gone"
            elif beat is None:
                why = "its lease holds no heartbeat glassloop wrote: damaged, or not glassloop's"
            elif age < 0:  # (a lease no clock that agrees with this one's wrote)
                why = f"its heartbeat is {-age:,.0f} s in the future, which is not believable"
            else:
                why = f"last heartbeat {age:.0f} s ago"
            self.say(
                f"run: taking over {self.shown} from a job that stopped without ending "
                f"({_owner(held)}, {why})"
            )
            self.fs.rm_file(self.path)
        try:
            done = self.fs.pipe_file(self.path, self._record(), mode="create")
        except FileExistsError:  # (another job created it between our read and our write)
            raise RunLeased(
                f"run: {self.shown} was just taken by another job starting at the same time; "
                "two jobs must not train into one URL"
            ) from None
        if isinstance(done, dict) and done.get("ETag"):  # (its heartbeats: If-Match on it)
            self.store.etags[self.path] = str(done["ETag"])
        try:
            self._take_generation()
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self.path)
            raise
        self._thread = threading.Thread(target=self._beat, name="glassloop-lease", daemon=True)
        self._thread.start()

    def _take_generation(self) -> None:
        """One more than the newest generation, its record created with the exclusive create
        (another job that took the same number first: the next one); the store's writes are
        fenced with it from now on."""
        for _ in range(8):
            newest = max(generations(self.fs, self.store.root), default=0)
            if newest >= LAST_GENERATION:
                raise GlassloopError(
                    f"run: {self.shown} has had {newest:,} jobs, the most glassloop numbers; "
                    "copy its newest checkpoint to a new URL and resume there"
                )
            folder = self.store.generation_dir(newest + 1)
            self.store.makedirs(folder)
            owner = {"host": self.mine["host"], "pid": self.mine["pid"]}
            try:
                self.fs.pipe_file(f"{folder}/{RECORD}", json.dumps(owner).encode(), mode="create")
            except FileExistsError:
                continue
            self.generation = newest + 1
            store = self.store
            store.fence, store.generation, store.owner = self.check, self.generation, owner
            return
        raise RunLeased(f"run: {self.shown} is being taken by several jobs at once")

    def check(self) -> None:
        """Raise :meth:`lost`'s error once a newer generation exists (another job took the run
        over): the store calls it before each of this job's writes."""
        if self._lost is None and self.generation:  # (one listing: any newer generation)
            newest = max(generations(self.fs, self.store.root), default=0)
            if newest > self.generation:
                newer = f"{self.store.generation_dir(newest)}/{RECORD}"
                self._lost = CheckpointWriteError(
                    f"run: {self.shown} was taken over by another job "
                    f"({_owner(self._json(newer))}) after this one stalled past "
                    f"{EXPIRES_S:.0f} s; this job stops and uploads nothing more (what it "
                    "uploaded before is intact)"
                )
        if self._lost is not None:
            raise self._lost

    def lost(self) -> Exception | None:
        """The error that stops this job once another has taken its run over."""
        return self._lost

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._lost is None and self._owned():
            self.fs.rm_file(self.path)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:  # (fenced: a job taken over writes no heartbeat over its successor's)
                self.store.put(self.path, self._record(), shared=True)
            except CheckpointWriteError:
                return  # lost: said at the next step row
            except Exception as err:  # (a network hiccup: the next beat tries again)
                self.say(f"warning: renewing the lease of {self.shown} failed: {err}")

    def _owned(self) -> bool:
        held = self._read()
        if held is None or held.get("token") != self.mine["token"]:
            return False
        try:
            self.check()
        except CheckpointWriteError:
            return False
        return True

    def _read(self) -> dict[str, Any] | None:
        """The lease as it is in the store (``{}``: one that cannot be a lease, damaged, over
        :data:`MAX_LEASE` bytes or nested too deep: taken over as a dead job's, and said so)."""
        try:
            held = self.store.read_json(self.path, MAX_LEASE)
        except FileNotFoundError:
            return None
        except (ValueError, RecursionError):
            return {}
        return held if isinstance(held, dict) else {}

    def _json(self, path: str) -> dict[str, Any]:
        """The JSON object at ``path`` (a newer generation's owner), ``{}`` when unreadable."""
        try:
            found = self.store.read_json(path, MAX_LEASE)
        except (OSError, ValueError, RecursionError):
            return {}
        return found if isinstance(found, dict) else {}

    def _record(self) -> bytes:
        return json.dumps({**self.mine, "heartbeat": time.time()}).encode("utf-8")


def _heartbeat(value: Any) -> float | None:
    """A heartbeat as read back: a finite number of seconds, else ``None`` (no heartbeat)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _alive(pid: Any) -> bool:
    """Whether process ``pid`` of this machine still runs (a job killed here, ``kill -9``,
    leaves its lease behind: its own requeue on this machine need not wait for the expiry)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        return True
    return True


def _owner(held: dict[str, Any]) -> str:
    """Who holds a lease, as it says (never its control characters: a forged line)."""
    return f"host {printable(held.get('host', '?'), 64)}, PID {printable(held.get('pid', '?'), 16)}"
