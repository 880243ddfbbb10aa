"""A run directory, opened once: a :class:`RunDir` is where the run is written (a folder; for a
URL, the local copy and the remote run it mirrors), the lock held for a whole ``fit``, how
long its checkpoints took and the frozen base its final weights leave out. The Trainer builds
one and hands it to the run directory's two writers: the run log (config, status, metric
rows, final weights: :mod:`glassloop.tracking.run_log`) and the checkpointer
(:mod:`glassloop.checkpoint.checkpointer`); the names of what they write are
:mod:`glassloop.run_dir.layout`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from glassloop.distributed.world import SINGLE, World, all_reduce, arrive_together
from glassloop.errors import CheckpointError, GlassloopError, write_failure
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import clean_temporaries
from glassloop.run_dir.layout import CHECKPOINTS, LATEST, STEP_DIR
from glassloop.run_dir.lock import RunLock
from glassloop.run_dir.remote import RemoteRun, Usable, open_run_dir
from glassloop.state import SaveTimes
from glassloop.storage.atomic import ForeignPathError
from glassloop.storage.frozen_base import FrozenBase


class RunDir:
    """The run directory ``run_dir`` (a path, a URL, or ``None``: a run that writes nothing)
    as this process sees it; only the main process writes its files (``writes``)."""

    def __init__(self, run_dir: str | Path | None, world: World = SINGLE) -> None:
        self.path: Path | None
        self.remote: RemoteRun | None
        # A URL (s3://...): a local copy, uploaded to the remote run (glassloop.run_dir.remote).
        self.path, self.remote = open_run_dir(run_dir)
        self.world = world
        self.writes = self.path is not None and world.is_main
        self.times = SaveTimes(active=self.path is not None)  # run.json, epoch rows
        # What the run is called on screen: its URL (redacted) for a remote run, never the
        # local copy's path in the cache.
        self.shown = self.remote.shown if self.remote is not None else str(self.path)
        # What the final weights leave out (a fine-tuned model's frozen base, set by the
        # checkpointer from checkpoint.final_weights); None: they are whole.
        self.base: FrozenBase | None = None

    def mirror(self, keep_last: int, say: Callable[[str], None], *, sharded: bool) -> None:
        """How a remote run is mirrored: the checkpoints its pruning keeps, where its lines go.
        A sharded (FSDP) run on several nodes is refused: each node writes its shards into
        its own local copy, and only rank 0's node uploads."""
        if self.remote is None:
            return
        self.remote.keep_last, self.remote.say = keep_last, say
        if sharded and self.world.several_nodes:
            raise GlassloopError(
                f"run: train.strategy = 'fsdp' on several nodes writes each node's shards on "
                f"that node, and a run on object storage ({self.shown}) uploads one node's "
                "local copy: use a shared filesystem for the run directory, or DDP"
            )

    @contextlib.contextmanager
    def hold(self, usable: Usable | None = None) -> Iterator[None]:
        """Create the run directory, hold its lock (one training process per directory) and
        remove what an interrupted glassloop left in it, for the whole ``fit`` (a remote run:
        pulled first, its newest checkpoint that ``usable`` takes; on each node of several,
        by its first process into the node's own local copy, read but never written)."""
        if self.remote is not None and not self.writes and self.world.local_rank == 0:
            with self.remote.held(usable, writes=False) as pulled:  # (another node's copy)
                self._same_on_every_node(pulled)
                yield
            return
        if not self.writes:
            self._same_on_every_node(None)
            yield
            return
        assert self.path is not None
        remote = self.remote.held(usable) if self.remote is not None else contextlib.nullcontext()
        with remote as pulled, self._held(self.path):  # (a remote run: pulled first, then held)
            self._same_on_every_node(pulled)
            yield

    def _same_on_every_node(self, pulled: str | None) -> None:
        """Every node pulled the same checkpoint of a remote run (each pull takes the newest
        that verifies there: a download damaged on one node would fall back alone), else one
        line in every process, before any of them resumes from its node's copy."""
        if self.remote is not None and self.world.distributed:
            # (each node's first process pulls, rank 0 takes the lease too: it may take longer
            # than a collective's timeout, which the others do not wait for here)
            arrive_together("pulled", "the pull of the run")
        if self.remote is None or not self.world.several_nodes:
            return
        puller = self.world.local_rank == 0
        step = int(pulled.rsplit("-", 1)[-1]) if pulled and pulled[-1].isdigit() else 0
        newest = all_reduce(torch.tensor([step if puller else -1]), "max").item()
        oldest = all_reduce(torch.tensor([step if puller else 1 << 62]), "min").item()
        if newest != oldest:
            raise CheckpointError(
                f"checkpoint: the nodes pulled different checkpoints of {self.shown} (steps "
                f"{oldest} to {newest}: one node fell back past a checkpoint that did not "
                "verify there; see its lines); nothing was trained: run the job again"
            )

    @contextlib.contextmanager
    def _held(self, run_dir: Path) -> Iterator[None]:
        if run_dir.exists() and not run_dir.is_dir():
            raise GlassloopError(f"run: '{run_dir}' is a file, not a run directory")
        refuse_links(run_dir)  # before anything, the lock included, is written
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir)
            lock.acquire()
        except OSError as err:
            named = getattr(err, "filename", None)
            where = Path(named) if isinstance(named, str) else run_dir
            raise write_failure(
                where, err, safe="the checkpoints written so far are intact"
            ) from err
        try:
            clean_temporaries(run_dir)
            yield
        finally:
            lock.release()


def refuse_links(run_dir: Path) -> None:
    """Stop before anything is written when a symbolic link sits where glassloop keeps its
    own files (a checkpoint or ``best/`` linked to another disk, a prepared run directory):
    glassloop never writes, replaces or deletes through one, so the run could not go on."""
    found = [run_dir / name for name in layout.OWN_NAMES if (run_dir / name).is_symlink()]
    owned_folders = (
        (run_dir / CHECKPOINTS, STEP_DIR.pattern),
        (run_dir / layout.REPORT, ""),
        (run_dir / layout.PROFILE, ""),
    )
    for folder, owned in owned_folders:
        if folder.is_dir() and not folder.is_symlink():
            found += [
                p
                for p in sorted(folder.iterdir())
                if p.is_symlink() and (not owned or STEP_DIR.match(p.name) or p.name == LATEST)
            ]
    if found:
        names = ", ".join(f"'{p}'" for p in found)
        raise ForeignPathError(
            f"run: {names} {'is a symbolic link' if len(found) == 1 else 'are symbolic links'}"
            " where glassloop keeps its own files; glassloop never writes, replaces or deletes"
            " through a link and left everything untouched: remove the link(s) (their targets"
            " stay as they are), or choose another --run-dir"
        )
