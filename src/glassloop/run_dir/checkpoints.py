"""Atomic, pickle-free, verified checkpoints; keep-last pruning; the best checkpoint.

Layout of a run directory::

    RUN_DIR/checkpoints/step-00000120/   model.safetensors   weights (no module./_orig_mod.)
                                         state.safetensors   every other tensor of the state
                                         state.json          the rest (structure, numbers)
                                         meta.json           format, step, epoch, metrics,
                                                             config, versions, git SHA
                                         manifest.json       size + SHA-256 of each file,
                                                             written last
    RUN_DIR/checkpoints/latest           name of the newest committed checkpoint
    RUN_DIR/best/                        a copy of the best checkpoint (checkpoint.monitor)

A checkpoint is written into ``checkpoints/.tmp-...`` (same filesystem), each file fsync'd,
then renamed into place and the parent fsync'd; only then does ``latest`` move (the same way).
A crash at any moment leaves the previous checkpoint and pointer intact; leftovers are removed
at the next start. Nothing here ever unpickles: weights and state tensors are safetensors
(headers checked before anything is allocated), everything else is JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from glassloop.errors import CheckpointError
from glassloop.errors import CheckpointWriteError as CheckpointWriteError
from glassloop.run_dir import layout
from glassloop.run_dir.layout import CHECKPOINT_FILES as FILES
from glassloop.run_dir.layout import CHECKPOINTS, LATEST, SHARDS, STEP_DIR
from glassloop.run_dir.manifest import (
    CREATOR,
    FORMAT_VERSION,
    compare_digests,
    listed_files,
    read_json,
    verify_files,
)
from glassloop.storage.atomic import (
    NOFOLLOW,
    ForeignPathError,
    fsync_dir,
    fsync_file,
    refuse_link,
    remove_tree,
)
from glassloop.storage.hashed_files import read_hashed, write_digested, write_safetensors
from glassloop.storage.serialization import sha256_of, unflatten
from glassloop.storage.snapshot import Snapshot
from glassloop.storage.weights import (
    all_finite,
    header_shapes,
    read_safetensors_header,
    weights_finite,
    weights_metadata,
)

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
TRASH_PREFIX = ".trash-"
# What glassloop itself leaves behind when it is cut short; nothing else is ever touched.
# A directory also needs MARKER inside (or to be empty) before it is removed.
MARKER = ".glassloop"
LEFTOVER_DIR = re.compile(r"^\.(tmp|old|trash)-(step-\d{8}|best)-\d+$")
LEFTOVER_FILE = re.compile(
    r"^\.(latest|run\.json|config\.json|model\.safetensors|metrics\.csv|metrics\.jsonl)"
    r"\.tmp(-\d+)?$"
)


# ------------------------------------------------------------------------------ checkpoints
@dataclass
class Checkpoint:
    """A verified checkpoint read from disk."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]
    model_tensors: dict[str, torch.Tensor]  # model.safetensors, already read and checked
    model_metadata: dict[str, str]
    sharded: bool = False  # an FSDP run's: the weights are in shards/ (glassloop.distributed.fsdp)

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def weights(self) -> Path:
        return self.path / layout.WEIGHTS


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Our committed checkpoint directories, oldest first (foreign folders are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return [p for p in step_dirs(run_dir) if _ours(p)]


# A resuming side's test of the state it reads back (meta.json's and state.json's trees):
# raises ValueError/TypeError/KeyError for numbers that cannot be right.
StateCheck = Callable[[Any, Any], None]
# The resuming side's test of a checkpoint's weights: (meta, each key's shape and dtype, path).
WeightsCheck = Callable[[Any, dict[str, tuple[list[int], str]], Path], None]


def require_run_dir(run_dir: Path) -> None:
    """Refuse to write into a run directory that disappeared during the run (never recreate
    it half-empty, without its config and metrics)."""
    if not run_dir.is_dir():
        raise CheckpointWriteError(
            f"checkpoint: the run directory '{run_dir}' disappeared during the run "
            "(deleted or unmounted?); not recreating it without its config and metrics"
        )


def step_dirs(run_dir: Path) -> list[Path]:
    """Every ``step-XXXXXXXX`` directory that glassloop wrote, committed or damaged (it holds
    the marker, a manifest or one of the checkpoint files), oldest first. A user's folder
    of that name is not one; a symbolic link never is (following it could leave the run
    directory)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if STEP_DIR.match(p.name) and p.is_dir() and not p.is_symlink() and looks_ours(p)
    ]
    return sorted(found, key=lambda p: p.name)


def looks_ours(path: Path) -> bool:
    """A folder glassloop wrote, committed or damaged: it holds the marker, a manifest or
    one of the checkpoint files."""
    return any(os.path.lexists(path / name) for name in (MARKER, layout.MANIFEST, *FILES))


def _ours(path: Path) -> bool:
    """A directory glassloop committed: its manifest says so."""
    try:
        manifest = json.loads((path / layout.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("creator") == CREATOR


def latest_pointer(run_dir: Path) -> Path | None:
    """The step folder ``checkpoints/latest`` names; ``None`` when it is missing, unreadable,
    not text (a binary file) or not a step folder's name: a resume then looks at the step
    folders themselves (:func:`find_resumable`), as for a damaged pointer."""
    pointer = checkpoints_dir(run_dir) / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return checkpoints_dir(run_dir) / name if STEP_DIR.match(name) else None


def clean_temporaries(run_dir: Path) -> list[Path]:
    """Remove what an interrupted write or prune of glassloop left behind; return what was
    removed. Only exact glassloop names are touched (``.tmp-step-00000120-4242``,
    ``.latest.tmp-4242``, ...), a directory only if it carries glassloop's marker file (or is
    empty), and never through a symbolic link: a user's ``.tmp-mydata`` stays where it is."""
    removed: list[Path] = []
    for root in (checkpoints_dir(run_dir), Path(run_dir)):
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.is_symlink():
                continue
            if path.is_file() and LEFTOVER_FILE.match(path.name):
                path.unlink()
                removed.append(path)
                continue
            found = LEFTOVER_DIR.match(path.name)
            if not found or not path.is_dir() or not _marked(path):
                continue
            original = root / found.group(2)
            if found.group(1) == "old" and not os.path.lexists(original) and _ours(path):
                os.replace(path, original)  # a replace was cut between its renames: undo
            else:
                remove_marked(path)
            removed.append(path)
    return removed


def _marked(path: Path) -> bool:
    """A directory glassloop created: it holds the marker, or nothing at all."""
    return (path / MARKER).is_file() or not any(path.iterdir())


def remove_marked(path: Path) -> None:
    """Delete a directory glassloop created, its marker last, so that a kill half-way
    leaves a directory that :func:`clean_temporaries` still recognises (never through a
    link: :func:`glassloop.storage.atomic.remove_tree`)."""
    remove_tree(path, last=MARKER)


def staging_dir(target: Path, owner: int) -> Path:
    """Where the checkpoint for ``target`` is written before it is renamed into place
    (``owner``: the writing process's pid; rank 0's in a sharded save)."""
    return target.parent / f"{TMP_PREFIX}{target.name}-{owner}"


def begin_staging(tmp: Path) -> None:
    """An empty staging directory, marked as glassloop's (see :func:`clean_temporaries`)."""
    if os.path.lexists(refuse_link(tmp)):  # our exact name and pid: a leftover of ours
        remove_tree(tmp)
    tmp.mkdir(parents=True)
    mark(tmp)  # says "glassloop made this" to clean_temporaries


def mark(folder: Path) -> None:
    """Put glassloop's marker into ``folder`` (never through a link of that name)."""
    marker = refuse_link(folder / MARKER)
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | NOFOLLOW, 0o644))


def stage_checkpoint(target: Path, snap: Snapshot, *, staged: Path | None = None) -> Path:
    """Write a complete checkpoint for ``target`` into its staging folder (returned): each
    file hashed while it is written and fsync'd once, the manifest last, then the folder; a
    store's ``write`` puts it in place (:class:`glassloop.run_dir.local_store.LocalStore`).

    ``snap.weights=None``: a sharded checkpoint, whose tensors the processes already wrote into
    ``staged/shards/`` (:mod:`glassloop.distributed.fsdp`); the manifest covers those files too."""
    tmp = staged if staged is not None else staging_dir(target, os.getpid())
    if staged is None:
        begin_staging(tmp)
    try:
        # The two tensor files side by side: SHA-256 runs at ~1.3 GB/s on one core, slower
        # than a fast disk writes, so two hash at once (benchmarks/checkpoint_speed.py).
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="glassloop-write") as pool:
            state_file = pool.submit(
                write_safetensors, snap.tensors, tmp / layout.STATE_TENSORS, None
            )
            files: dict[str, tuple[int, str]] = {}
            if snap.weights is not None:
                files[layout.WEIGHTS] = write_safetensors(
                    snap.weights, tmp / layout.WEIGHTS, snap.weights_metadata
                )
            files[layout.STATE_TENSORS] = state_file.result()
        files[layout.STATE_JSON] = write_digested(tmp / layout.STATE_JSON, [snap.tree])
        files[layout.META] = write_digested(tmp / layout.META, [snap.meta])
        if (tmp / SHARDS).is_dir():  # written by every process's DCP: hashed here
            for file in sorted((tmp / SHARDS).rglob("*")):
                if file.is_file() and not file.is_symlink():
                    fsync_file(file)
                    name = file.relative_to(tmp).as_posix()
                    files[name] = (file.stat().st_size, sha256_of(file))
            fsync_dir(tmp / SHARDS)
        entries = {name: {"size": size, "sha256": sha} for name, (size, sha) in files.items()}
        manifest = {
            "creator": CREATOR,
            "format": FORMAT_VERSION,
            "files": dict(sorted(entries.items())),
        }
        write_digested(tmp / layout.MANIFEST, [json.dumps(manifest, indent=1).encode("utf-8")])
        fsync_dir(tmp)
    except BaseException:
        with contextlib.suppress(OSError, ForeignPathError):
            remove_marked(tmp)
        raise
    return tmp


def last_good(run_dir: Path) -> str:
    """The checkpoint ``latest`` names, for a failure's message ("none" before the first)."""
    last = latest_pointer(run_dir)
    return str(last) if last is not None else "none"


def refuse_not_finite(run_dir: Path, model: nn.Module | dict[str, torch.Tensor], step: int) -> None:
    """Never a checkpoint of NaN/inf weights over good ones."""
    if not weights_finite(model):
        raise not_finite(step, last_good(run_dir))


def not_finite(step: int, last_good: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint: the weights at step {step} are not finite (NaN/inf); not saving them "
        f"over good checkpoints. Last good checkpoint: {last_good}"
    )


# What reading a damaged or swapped file may raise besides CheckpointError (an I/O error, a
# link in a file's place, a truncated header, JSON of another shape).
UNREADABLE = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    struct.error,
    SafetensorError,
)


def read_checkpoint(
    path: Path, check: StateCheck | None = None, fits: WeightsCheck | None = None
) -> Checkpoint:
    """Verify every file against the manifest (size, SHA-256), then read and check it: strict
    JSON, well-formed safetensors, finite tensors, and a training state whose numbers and RNG states
    make sense (``check(meta, state)``: the resuming side's test of its own state, e.g.
    :func:`glassloop.checkpoint.resume.check_training_state`; storage knows no state's
    layout); ``fits(meta, shapes, path)``: the weights' keys, shapes and dtypes fit the model, from
    the header, before a tensor is read (a file may hold 300,000 of them). Any problem is one
    :class:`CheckpointError` naming the path and the reason, raised before anything is loaded into a
    model or optimizer. Each file is read once, hashed as it is read (the tensors are made from
    the very bytes hashed); a problem found on the way is named only after every file was
    hashed, so a corrupt file is always named as such (:func:`verify_files`)."""
    path = Path(path)
    files, sharded = listed_files(path)
    try:
        return _read_verified(path, files, sharded, check, fits)
    except CheckpointError:
        verify_files(path)  # (a file that fails its SHA-256 check: that is the problem)
        raise
    except UNREADABLE as err:
        # (a read that failed, a link put in a file's place, a meta.json of the right size
        # but another shape): one line too, and a resume goes on to an older checkpoint
        verify_files(path)
        raise CheckpointError(
            f"checkpoint: '{path}' cannot be read ({type(err).__name__}: {err})"
        ) from err


def _read_verified(
    path: Path,
    files: dict[str, Any],
    sharded: bool,
    check: StateCheck | None,
    fits: WeightsCheck | None,
) -> Checkpoint:
    digests: dict[str, str] = {}
    meta = read_json(path / layout.META, path, digests)
    tree = read_json(path / layout.STATE_JSON, path, digests)
    model: tuple[dict[str, torch.Tensor], str, list[str]] = ({}, "", [])
    # The two tensor files side by side: one SHA-256 runs at ~1.8 GB/s, slower than a read.
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="glassloop-read") as pool:
        state_file = pool.submit(_read_tensors, path / layout.STATE_TENSORS)
        # a sharded one's shards/: hashed side by side too (read by whoever needs them)
        rest = files.keys() - digests - {layout.WEIGHTS, layout.STATE_TENSORS}
        shards = {name: pool.submit(sha256_of, path / name) for name in rest}
        if not sharded:  # (a sharded one's weights are read by whoever needs them)
            header = read_safetensors_header(path / layout.WEIGHTS)
            if fits is not None:
                fits(meta, header_shapes(header), path)  # before a tensor is read
            model = _read_tensors(path / layout.WEIGHTS, header, copy=False)  # (copied on load)
            digests[layout.WEIGHTS] = model[1]
        state_tensors, digests[layout.STATE_TENSORS], bad_state = state_file.result()
        digests.update({name: shard.result() for name, shard in shards.items()})
    compare_digests(path, files, digests)
    for name, bad in (("model", model[2]), ("state", bad_state)):
        if bad:
            raise CheckpointError(
                f"checkpoint: '{path}': {name}.safetensors holds NaN/inf values (in "
                f"'{bad[0]}'); not resuming from it"
            )
    try:
        state = unflatten(tree, state_tensors)
        if check is not None:
            check(meta, state)
    except (KeyError, IndexError, ValueError, TypeError, OverflowError, RuntimeError) as err:
        raise CheckpointError(
            f"checkpoint: '{path}': the training state is malformed ({type(err).__name__}: {err})"
        ) from err
    # a sharded one's metadata, as model.safetensors would carry it
    metadata = weights_metadata(meta.get("model_spec")) if sharded else header["__metadata__"]
    return Checkpoint(path, meta, state, model[0], dict(metadata or {}), sharded)


def _read_tensors(
    file: Path, header: dict[str, Any] | None = None, *, copy: bool = True
) -> tuple[dict[str, torch.Tensor], str, list[str]]:
    """A safetensors file's tensors (its header checked first; ``copy``: :func:`read_hashed`),
    its SHA-256 and the names of its tensors that are not finite."""
    tensors, digest = read_hashed(file, header or read_safetensors_header(file), copy=copy)
    return tensors, digest, [k for k, t in tensors.items() if not all_finite(t)]


def find_resumable(
    run_dir: Path, check: StateCheck | None = None, fits: WeightsCheck | None = None
) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and what is wrong with each newer one (every
    ``step-`` folder counts, also one whose manifest is unreadable, whose state fails
    ``check``, or that ``fits`` refuses: weights that do not fit the model)."""
    problems: list[str] = []
    # Newest first. A committed directory is complete (renamed into place only after its
    # manifest was written), so one newer than `latest` (a crash between the rename and the
    # pointer move) is as good as the one `latest` names.
    for path in reversed(step_dirs(run_dir)):
        try:
            return read_checkpoint(path, check, fits), problems
        except CheckpointError as err:
            problems.append(short(str(err)))
    return None, problems


def short(problem: str, limit: int = 500) -> str:
    """A problem as one line quotes it: at most ``limit`` characters (a crafted file's own
    text can be megabytes)."""
    return problem if len(problem) <= limit else f"{problem[: limit - 3]}..."
