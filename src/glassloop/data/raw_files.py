"""Files a user hands over, read without torch (``glassloop predict`` on an ONNX file imports
none): images (:func:`open_image`), arrays (:func:`load_arrays`, never unpickling) and CSV rows
(:func:`read_csv_rows`), each way a file can fail one :class:`DataError` line."""

from __future__ import annotations

import contextlib
import csv
import io
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from glassloop.errors import DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


@contextlib.contextmanager
def open_image(path: Path | bytes, who: str) -> Iterator[Any]:
    """Pillow's ``Image.open``, with every way an image file can fail (unreadable, not an
    image, truncated or corrupt data while decoding in the ``with`` block, a decompression
    bomb: a small file that claims billions of pixels, a PNG text chunk too large) turned
    into one :class:`DataError` line. Pillow only warns between 89M and 179M pixels; here
    that is an error too."""
    import struct
    import zlib

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as opened:
                yield opened
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        IndexError,
        struct.error,
        zlib.error,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as err:
        name = "image bytes" if isinstance(path, bytes) else f"image '{path}'"
        raise DataError(f"{who}: cannot read {name}: {err}") from err


def load_arrays(path: Path, who: str) -> dict[str, np.ndarray]:
    """Every array of a ``.npz`` (or the one of a ``.npy``, as ``"arr_0"``), never unpickling;
    an empty, truncated or foreign file is one :class:`DataError`, and so is an array that
    is not rows of numbers (:func:`check_array_headers`: before anything is allocated)."""
    check_array_headers(path, who)
    try:
        loaded = np.load(path, allow_pickle=False)  # never unpickles
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {k: np.asarray(loaded[k]) for k in loaded.files}
        return {"arr_0": np.asarray(loaded)}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise DataError(
            f"{who}: '{path}' is not a readable {path.suffix} file: {err or type(err).__name__}"
        ) from err


# The kinds of numbers glassloop reads from an array file: booleans, integers, floats.
NUMBER_KINDS = "biuf"


def check_array_headers(path: Path, who: str) -> None:
    """Each array's header in a ``.npy`` or ``.npz`` file, read before its data: rows (not
    one value, a 0-d array), of numbers (not strings, objects or complex values, which
    numpy would turn into a float array with a warning, keeping the real part), and no
    more bytes than the file holds (a header claiming (10**12, 10**6) float32 values made
    numpy try to allocate 3.47 EiB before it compared that with the file)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    if info.filename.endswith(".npy"):
                        with archive.open(info) as handle:
                            name = info.filename.removesuffix(".npy")
                            _check_header(handle, info.file_size, f"'{path}' array {name!r}", who)
        else:
            with path.open("rb") as handle:
                _check_header(handle, path.stat().st_size, f"'{path}'", who)
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(
            f"{who}: '{path}' is not a readable {path.suffix} file: {err or type(err).__name__}"
        ) from err


def _check_header(handle: Any, size: int, what: str, who: str) -> None:
    major, _ = np.lib.format.read_magic(handle)
    read = (
        np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    )
    shape, _, dtype = read(handle)  # (numpy's own reader: it checks the header's form)
    if dtype.kind not in NUMBER_KINDS:
        complex_ = dtype.kind == "c"
        kind = "complex numbers" if complex_ else f"{dtype} values, not numbers"
        how = "x.real, if its real part is what you mean" if complex_ else "x.astype(np.float32)"
        raise DataError(
            f"{who}: {what} holds {kind}; glassloop reads integers, floats or booleans: "
            f"convert it first ({how})"
        )
    if shape == ():
        raise DataError(f"{who}: {what} holds a single value (a 0-d array), not rows of samples")
    claimed = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if claimed > size - handle.tell():
        raise DataError(
            f"{who}: {what} claims {shape} {dtype} values ({claimed:,} bytes), more than the "
            f"file holds ({size:,} bytes): truncated or crafted"
        )


@contextlib.contextmanager
def reading_text(path: Path) -> Iterator[None]:
    """Reading ``path`` as UTF-8 text (a CSV file, JSON lines): each failure one line."""
    try:
        yield
    except UnicodeDecodeError as err:
        raise DataError(
            f"data: '{path}' is not UTF-8 text (byte {err.start}); save it as UTF-8"
        ) from err
    except csv.Error as err:
        raise DataError(f"data: '{path}' is not a readable CSV file: {err}") from err


def read_csv_rows(path: Path) -> list[list[str]]:
    """The rows of a CSV file, which must be UTF-8 text."""
    with reading_text(path), path.open(newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def is_float(value: str) -> bool:
    """Whether a CSV cell reads as a number."""
    with contextlib.suppress(ValueError):
        float(value)
        return True
    return False
