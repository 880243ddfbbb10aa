"""Names from outside as file names: the one place where a name that a user, a callback or
a file supplies becomes part of a file name.

Names enter glassloop as a model's heads (``task={"kind": "classification"}``), validation
sets (``fit(train, {"ood": loader})``, ``data.val_sets``), named metrics
(``metrics={"f1": ...}``), the keys a callback or a ``train_step`` adds to a row, and the keys
read back from a run's ``metrics.jsonl`` (a run directory is copied, downloaded and shared:
its files are input). Where a name enters it is checked: :func:`check_name` for the names
glassloop builds its keys from, :func:`check_key` for a row's keys; a name that cannot be
used is one line (exit code 2) before anything is trained. Where a file name is built from a
name, :func:`file_name` turns it into a safe, bounded slug, so that even a name that was never
checked (a key in a downloaded run's files) names a file inside the folder it is meant for.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from glassloop.errors import ConfigError

MAX_NAME = 64  # a head, set or metric: the keys built from it (val_<set>_<metric>) stay short
MAX_KEY = 200  # a row's key (a metric a callback adds)
MAX_STEM = 100  # characters of a file name before its suffix (filesystems allow 255 bytes)
# A letter, digit or _ (any script's), then those, '-' and '.': no separator, no "..", no
# leading dot (a hidden file), nothing a CSV header or a console line breaks on.
NAME = re.compile(r"\w[\w.-]*")
# What a file name keeps of a name: portable on every filesystem (Windows' reserved
# characters, macOS's NFD normalisation and non-UTF-8 Linux locales never change it).
UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def check_name(name: Any, what: str) -> str:
    """``name`` if glassloop can build keys and file names from it, else one line saying
    which ``what`` it is and what a name may hold.

    >>> check_name("kind", "task: head")
    'kind'
    >>> check_name("../x", "task: head")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    glassloop.errors.ConfigError: task: head '../x' cannot be used as a name: give 1 to 64 ...
    """
    if isinstance(name, str) and len(name) <= MAX_NAME and NAME.fullmatch(name):
        return name
    raise ConfigError(
        f"{what} {_shown(name)} cannot be used as a name: give 1 to {MAX_NAME} letters, digits, "
        "'_', '-' or '.', starting with a letter, digit or '_' (it names keys and files)"
    )


def check_key(key: Any, what: str) -> str:
    """``key`` if a row of the run's files can hold it: a string of 1 to :data:`MAX_KEY`
    printable characters (a newline or a NUL would break the CSV header, and so the resume
    that reads it back). Keys may hold anything else (``loss/train``, ``f1@0.5``): a file
    named after one is named by :func:`file_name`.

    >>> check_key("val_f1@0.5", "metrics: key")
    'val_f1@0.5'
    """
    if isinstance(key, str) and 0 < len(key) <= MAX_KEY and key.isprintable():
        return key
    raise ConfigError(
        f"{what} {_shown(key)} cannot be written to the run's files: give 1 to {MAX_KEY} "
        "printable characters (no newline, tab or NUL)"
    )


def file_name(name: str, suffix: str = "") -> str:
    """A file name for ``name`` (and ``suffix``): ``name`` itself when it is already safe
    and short, else its safe characters, cut to :data:`MAX_STEM`, and 8 hex digits of its
    SHA-256 (two names never share a file). Never a path, a hidden file, ``.`` or ``..``.

    >>> file_name("val_accuracy", ".png")
    'val_accuracy.png'
    >>> file_name("val_x/../../elsewhere/photo", ".png")
    'val_x_.._.._elsewhere_photo-0995d6ac.png'
    """
    stem = UNSAFE.sub("_", name).lstrip(".")
    if stem != name or len(stem) > MAX_STEM:
        # (surrogatepass: a key json.loads read may hold a lone surrogate)
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        stem = f"{stem[: MAX_STEM - 9]}-{digest}"
    return stem + suffix


def _shown(name: Any) -> str:
    """``name`` for an error line: quoted with its escapes (a newline stays ``\\n``), cut."""
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(str(name))} characters)"


# A URL's scheme: a run directory named so is on another filesystem (glassloop.run_dir.remote).
URL = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.IGNORECASE)


def is_url(run_dir: object) -> bool:
    """Whether ``run_dir`` is a string naming a filesystem other than the local one
    (``file://`` is local).

    >>> is_url("s3://bucket/run"), is_url("runs/x"), is_url("file:///tmp/x")
    (True, False, False)
    """
    found = URL.match(str(run_dir)) if isinstance(run_dir, str) else None
    return found is not None and found.group(1).lower() != "file"
