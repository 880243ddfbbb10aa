"""One writer per URL: a lease object in the store, so that a second job training into the
same ``s3://...`` run is refused while the first lives, and takes over once the first is gone.

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
the same way. Object stores have no compare-and-swap on an update, so a heartbeat reads the
lease before it writes: a job that finds another owner there (it stalled past the expiry and
was taken over) has lost the run and stops at its next step row, uploading nothing more.
Heartbeat times are wall-clock seconds: the machines' clocks are taken to agree to within a few
seconds, far less than :data:`EXPIRES_S`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from glassloop.errors import CheckpointWriteError, GlassloopError

HEARTBEAT_S = 10.0  # how often the owner rewrites its lease
EXPIRES_S = 30.0  # a lease this much older than its heartbeat is a dead job's


class RunLeased(GlassloopError):
    """Another job holds the run's lease."""


class Lease:
    """``URL/.lease.json`` of the remote run at ``path`` in ``fs`` (see the module docstring):
    :meth:`acquire` before the first write, :meth:`release` at the end; :meth:`lost` is the
    error once another job has taken the run over (``None`` while it is this job's)."""

    def __init__(self, fs: Any, path: str, shown: str) -> None:
        self.fs, self.path, self.shown = fs, path, shown
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: Exception | None = None
        self.say: Any = print

    def acquire(self) -> None:
        """Take the lease, or raise :class:`RunLeased` naming the job that holds it and how
        long until it expires if that job is dead."""
        held = self._read()
        if held is not None:
            age = time.time() - _number(held.get("heartbeat"))
            gone = held.get("host") == self.mine["host"] and not _alive(held.get("pid"))
            if age < EXPIRES_S and not gone:
                raise RunLeased(
                    f"run: {self.shown} is being written by another job ({_owner(held)}, last "
                    f"heartbeat {max(age, 0):.0f} s ago); two jobs must not train into one URL. "
                    f"Wait for it to end; if it is dead, its lease expires in "
                    f"{EXPIRES_S - age:.0f} s and the same command then takes the run over"
                )
            why = "its process is gone" if gone else f"last heartbeat {age:.0f} s ago"
            self.say(
                f"run: taking over {self.shown} from a job that stopped without ending "
                f"({_owner(held)}, {why})"
            )
            self.fs.rm_file(self.path)
        try:
            self.fs.pipe_file(self.path, self._record(), mode="create")
        except FileExistsError:  # (another job created it between our read and our write)
            raise RunLeased(
                f"run: {self.shown} was just taken by another job starting at the same time; "
                "two jobs must not train into one URL"
            ) from None
        self._thread = threading.Thread(target=self._beat, name="glassloop-lease", daemon=True)
        self._thread.start()

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
            try:
                if not self._owned():
                    held = self._read() or {}
                    self._lost = CheckpointWriteError(
                        f"run: {self.shown} was taken over by another job ({_owner(held)}) "
                        f"after this one's heartbeat stalled past {EXPIRES_S:.0f} s; this job "
                        "stops and uploads nothing more (what it uploaded before is intact)"
                    )
                    return
                self.fs.pipe_file(self.path, self._record())
            except Exception as err:  # (a network hiccup: the next beat tries again)
                self.say(f"warning: renewing the lease of {self.shown} failed: {err}")

    def _owned(self) -> bool:
        held = self._read()
        return held is not None and held.get("token") == self.mine["token"]

    def _read(self) -> dict[str, Any] | None:
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache()  # (another job may have written since)
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            held = json.loads(data)
        except ValueError:  # (a damaged lease: as old as can be, taken over)
            return {}
        return held if isinstance(held, dict) else {}

    def _record(self) -> bytes:
        return json.dumps({**self.mine, "heartbeat": time.time()}).encode("utf-8")


def _number(value: Any) -> float:
    """A heartbeat as read back (anything but a finite number: as old as can be)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e12:
        return float(value)
    return 0.0


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
    return f"host {str(held.get('host', '?'))[:64]}, PID {str(held.get('pid', '?'))[:16]}"
