"""A checkpoint's manifest: the files it lists, each one's size and SHA-256, checked.

``manifest.json`` is written last into a checkpoint (:func:`glassloop.run_dir.checkpoints.
stage_checkpoint`); a checkpoint is only read after every file it lists is there, is no link,
has its size, and hashes to its SHA-256. A resume hashes each file as it reads it
(:func:`glassloop.run_dir.checkpoints.read_checkpoint`); :func:`verify_files` hashes them all
on their own (a store's pull, a refused read naming the corrupt file).
"""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from glassloop.errors import CheckpointError
from glassloop.run_dir import layout
from glassloop.run_dir.layout import CHECKPOINT_FILES as FILES
from glassloop.run_dir.layout import SHARDS
from glassloop.storage.redaction import printable
from glassloop.storage.serialization import sha256_of

FORMAT_VERSION = 1
CREATOR = "glassloop"
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")  # manifest names: no escape
MAX_JSON_BYTES = 256 * 1024 * 1024


def verify_files(path: Path) -> bool:
    """Every file the manifest of ``path`` lists has its size and SHA-256 (a sharded one's
    ``shards/``: nothing else); whether it is sharded. Else one :class:`CheckpointError`."""
    files, sharded = listed_files(path)
    with ThreadPoolExecutor(max_workers=2) as pool:  # (two files hashed at once, as written)
        digests = pool.map(sha256_of, [path / name for name in files])
        compare_digests(path, files, dict(zip(files, digests, strict=True)))
    return sharded


def listed_files(path: Path) -> tuple[dict[str, Any], bool]:
    """The manifest's entries of ``path``, each file there with its size (not yet hashed: a
    link, a missing or resized file is one :class:`CheckpointError`); whether it is sharded."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: '{path}' is not a checkpoint directory")
    manifest = read_json(path / layout.MANIFEST, path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint: '{path}' has an unknown manifest format")
    sharded = any(isinstance(name, str) and name.startswith(f"{SHARDS}/") for name in files)
    required = [name for name in FILES if not (sharded and name == layout.WEIGHTS)]
    for name in required:
        if not isinstance(files.get(name), dict):
            raise CheckpointError(f"checkpoint: '{path}': {name} is not in the manifest")
    if sharded:
        _check_shard_names(path, files)
    for name, entry in files.items():
        file = path / name
        if not isinstance(entry, dict) or not SAFE_NAME.match(name) or ".." in name:
            raise CheckpointError(f"checkpoint: '{path}': the manifest names {name!r}")
        if not file.is_file() or file.is_symlink():
            raise CheckpointError(f"checkpoint: '{path}': {name} is missing")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"checkpoint: '{path}': {name} has {size} bytes, the manifest says "
                f"{printable(entry.get('size'), 20)} (truncated or replaced)"
            )
    return files, sharded


def compare_digests(path: Path, files: dict[str, Any], digests: dict[str, str]) -> None:
    """Raise one :class:`CheckpointError` naming the first file whose SHA-256 is not the
    manifest's."""
    for name, entry in files.items():  # (in the manifest's order: the first bad one named)
        if digests[name] != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint: '{path}': {name} fails its SHA-256 check (corrupt or modified)"
            )


def _check_shard_names(path: Path, files: dict[str, Any]) -> None:
    """A sharded checkpoint's ``shards/`` holds exactly the files its manifest lists: DCP's
    reader reads every safetensors file in it, so an extra one would be loaded too."""
    listed = {name for name in files if name.startswith(f"{SHARDS}/")}
    present = (
        {f"{SHARDS}/{p.name}" for p in (path / SHARDS).iterdir()}
        if (path / SHARDS).is_dir()
        else set()
    )
    extra = sorted(present - listed)
    if extra:
        raise CheckpointError(f"checkpoint: '{path}': {extra[0]} is not in the manifest")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_json(file: Path, checkpoint: Path, digests: dict[str, str] | None = None) -> Any:
    """Strict JSON (``NaN``/``Infinity`` are refused: glassloop never writes them); the
    SHA-256 of the bytes read goes into ``digests``."""
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"checkpoint: '{checkpoint}': {file.name} is too large")
        data = file.read_bytes()
        if digests is not None:
            digests[file.name] = hashlib.sha256(data).hexdigest()
        return json.loads(data, parse_constant=_no_constant)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint: '{checkpoint}': {file.name} is missing") from err
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"checkpoint: '{checkpoint}': {file.name} is not valid JSON (corrupt, not a "
            "glassloop file, NaN/Infinity or nested too deeply)"
        ) from err
    except OSError as err:
        raise CheckpointError(f"checkpoint: cannot read '{file}': {err.strerror}") from err
