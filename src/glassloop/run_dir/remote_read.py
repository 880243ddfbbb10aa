"""A run on object storage read, never written, by the commands that look at a run: ``eval``,
``predict``, ``export``, ``report``, ``runs`` and ``verify-resume`` take its URL as they take a
local run directory.

What a command needs is pulled into glassloop's cache, ``remote-reads/`` beside the training
runs' ``remote-runs/`` (:func:`glassloop.run_dir.remote.local_copy_root`): the run's files and
its newest checkpoint whose every file verifies, exactly what a resume reads
(:meth:`glassloop.run_dir.remote.RemoteRun.pull`), into a folder of the command's own, locked
while it reads, so a training run on this machine, even of the same URL, is never disturbed.
Nothing is written to the bucket: what a command writes (a report) stays in the local copy,
and the command says where. Its lines name the run by its URL, not by the local copy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from glassloop.errors import CheckpointError, GlassloopError
from glassloop.run_dir import layout
from glassloop.run_dir.fsspec_store import FsspecStore
from glassloop.run_dir.remote import RemoteRun
from glassloop.storage.atomic import own_dir
from glassloop.storage.cache import cache_dir
from glassloop.storage.file_names import NAME

# What `glassloop runs` reads of each run in a folder of runs (never its weights or checkpoints).
SUMMARY_FILES = (layout.STATUS, layout.CONFIG, layout.METRICS_JSONL, layout.TRACKING)


def remote_reads_root() -> Path:
    """Where the commands' local copies of remote runs are kept: ``remote-reads`` in
    glassloop's cache (``$GLASSLOOP_CACHE_DIR``, default ``~/.cache/glassloop``)."""
    return cache_dir() / "remote-reads"


def _opened(url: str) -> RemoteRun:
    return RemoteRun(url, copies=remote_reads_root())


@contextlib.contextmanager
def read_run(url: str) -> Iterator[RemoteRun]:
    """The run at ``url`` in a local copy of this command's (``.local``), held while the
    caller reads it; an error raised meanwhile names the URL, not the local copy.

    A URL that holds no run (no ``run.json``, ``config.json`` or checkpoint) is one line."""
    remote = _opened(url)
    with remote.held(writes=False):
        found = (remote.local / name for name in (layout.STATUS, layout.CONFIG, layout.WEIGHTS))
        if not any(path.is_file() for path in found) and not remote.store.complete():
            raise GlassloopError(
                f"run: {remote.shown} holds no run (no run.json, config.json, "
                f"{layout.WEIGHTS} or complete checkpoint)"
            )
        yield remote


@contextlib.contextmanager
def read_runs(url: str) -> Iterator[RemoteRun]:
    """A folder of runs at ``url`` (or one run) in a local copy of this command's, each run's
    summary files only (:data:`SUMMARY_FILES`): what ``glassloop runs URL`` lists."""
    remote = _opened(url)
    with remote.held(writes=False):  # (the folder itself may be a run: pulled as read_run would)
        try:
            entries = remote.fs.ls(remote.root, detail=True)
        except FileNotFoundError:
            raise GlassloopError(f"runs: {remote.shown} does not exist") from None
        except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
            raise CheckpointError(
                f"runs: cannot read {remote.shown}: {remote.scrub(err)}; nothing was changed "
                "(check the network and the credentials, then run again)"
            ) from None  # (the driver's own error may hold what scrub removed)
        for entry in sorted(entries, key=lambda e: str(e["name"])):
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") != "directory" or not NAME.fullmatch(name):
                continue  # (a name from the bucket becomes a local folder: a plain one only)
            if not remote.fs.exists(remote.remote(name, layout.STATUS)):
                continue  # (not a run: a bucket's other folders)
            own_dir(remote.local / name)
            run = FsspecStore(remote.fs, remote.remote(name), remote.local / name, shown="")
            run.resolve()  # (its files as its newest record names them)
            for file in SUMMARY_FILES:
                remote.download(run.run_file(file), remote.local / name / file)
        yield remote


def read_config(url: str, into: Path) -> Path | None:
    """The run's own config.json at ``url`` (its newest record's), downloaded into the folder
    ``into``: what ``train --run-dir URL --resume`` without a config resumes with, as a local
    run's own (its local copy is the Trainer's to make, later). ``None``: the URL holds no
    config (a fresh run). At most 4 MiB, a config file's limit, is downloaded."""
    remote = _opened(url)
    try:
        remote.check_bucket()
        remote.store.resolve()
        source = remote.store.run_file(layout.CONFIG)
        if not remote.fs.exists(source):
            return None
        if (size := int(remote.fs.size(source))) > 4 << 20:
            raise GlassloopError(f"config: {remote.shown}/config.json has {size:,} bytes")
        remote.download(source, into / layout.CONFIG)
    except GlassloopError:
        raise
    except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
        raise CheckpointError(
            f"run: cannot read {remote.shown}/config.json: {remote.scrub(err)} (check the network "
            "and the credentials, then run again)"
        ) from None  # (the driver's own error may hold what scrub removed)
    return into / layout.CONFIG
