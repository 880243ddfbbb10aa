"""Parquet tables on disk, read lazily: a dataset larger than memory trains like one in it.

How: Parquet is compressed and column-chunked, so reading a row means decoding its whole
row group; random access over a shuffled epoch would decode the file again and again, and
reading a column decodes all of it into memory. So the file is converted once, streamed a
batch at a time, into an uncompressed Arrow IPC file in the cache directory (keyed by the
file's path, size and time), which every process then memory-maps: zero-copy, one row one
``Table.slice`` away, pages read when a row is asked for and dropped by the operating system
when memory is needed. This is what the Hugging Face ``datasets`` library does too; pyarrow
directly does it without that library's fingerprinting and dependency tree. Each worker
opens the file itself (the dataset pickles as a path and row indices, never as data), so
memory that is the process's own (not file cache) does not grow with the data set.

A row's inputs are the numeric ``feature_columns`` (standardised with the training split's
statistics), one ``image_column`` of encoded image bytes (PNG/JPEG, decoded in the worker,
scaled to [0, 1] and standardised per channel), or one ``text_column`` of strings (tokenized
in the worker by a tokenizer trained on the training texts, streamed from the file, or a
given ``tokenizer.json``; batched with dynamic padding, like ``text-csv``); the target is
``label_column`` (integer class indices or strings). Order, sharding and exact resume are
:class:`ResumableLoader`'s, as for every map-style dataset: per-epoch seeded order, position
in batches, no global RNG.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from glassloop.data.lazy import channel_stats, probe_shape, read_image, stats_sample
from glassloop.data.splits import check_class_count
from glassloop.data.text import PAD, TextData, tokenizer_for
from glassloop.errors import DataError
from glassloop.storage.atomic import atomic_path, refuse_link
from glassloop.storage.file_names import file_name


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError as err:
        raise DataError(
            "data: data.name = 'parquet' needs pyarrow: pip install 'glassloop[parquet]'"
        ) from err
    return pq


class ArrowRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows ``indices`` of an Arrow copy of a Parquet file and their labels. The table is
    memory-mapped lazily, in the process that reads (pickled, this is a path and indices)."""

    def __init__(self, path: Path, indices: np.ndarray, labels: np.ndarray) -> None:
        self.path = Path(path)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.labels = torch.as_tensor(np.asarray(labels)[self.indices], dtype=torch.int64)
        self._table: Any = None  # opened by the process that reads (workers: their own)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    def __len__(self) -> int:
        return len(self.indices)

    def table(self) -> Any:
        if self._table is None:
            self._table = open_arrow(self.path)
        return self._table


class ParquetRows(ArrowRows):
    """Rows ``indices`` of a Parquet file as ``(inputs, label)``; opened lazily per process.

    ``features``: numeric columns, standardised with ``mean``/``std``; or ``image_column``:
    encoded images decoded to ``image_shape`` ``(C, H, W)`` and standardised per channel.
    """

    def __init__(
        self,
        path: Path,
        indices: np.ndarray,
        labels: np.ndarray,
        *,
        features: list[str],
        image_column: str = "",
        image_shape: tuple[int, int, int] = (1, 0, 0),
        mean: list[float],
        std: list[float],
    ) -> None:
        super().__init__(path, indices, labels)
        self.features = features
        self.image_column = image_column
        self.image_shape = image_shape
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.table().slice(int(self.indices[index]), 1).to_pylist()[0]
        if self.image_column:
            x = read_image(row[self.image_column], self.image_shape)
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        else:
            x = torch.tensor([row[c] for c in self.features], dtype=torch.float32) - self.mean
            x = x / self.std
        return x, self.labels[index]


class ParquetTexts(ArrowRows):
    """Rows ``indices`` of a Parquet text column as token ids (cut at ``max_length``) and
    labels; opened and tokenized lazily per process (the tokenizer travels as its JSON)."""

    def __init__(
        self,
        path: Path,
        indices: np.ndarray,
        labels: np.ndarray,
        *,
        column: str,
        tokenizer_json: str,
        max_length: int,
        pad_id: int,
        lengths: list[int],
    ) -> None:
        super().__init__(path, indices, labels)
        self.column = column
        self.tokenizer_json = tokenizer_json
        self.max_length = max_length
        self.pad_id = pad_id
        self.lengths = lengths  # token counts (for length buckets), computed once
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_tokenizer": None}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
        text = self.table().column(self.column)[int(self.indices[index])].as_py()
        ids = self._tokenizer.encode(text).ids[: self.max_length] or [self.pad_id]
        return torch.tensor(ids, dtype=torch.long), self.labels[index]


def arrow_copy(parquet: Path) -> Path:
    """The uncompressed Arrow IPC copy of ``parquet`` in the cache directory, written once
    (a row group at a time: memory is bounded by the largest row group) and atomically, with
    its size and CRC-32 beside it (``.crc``). A copy that does not match them (truncated,
    emptied, a flipped bit) is written again; a cache folder that cannot be written is one
    line saying where it is. The key is the file's path, size and modification time: a file
    rewritten with the same size and time keeps its old copy (delete the copy, or touch the
    file)."""
    import hashlib

    from glassloop.storage.cache import cache_dir

    stat = parquet.stat()
    key = hashlib.sha256(f"{parquet.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    # (the data file's own name, bounded: a 250-character one made a name the disk refused)
    target = cache_dir() / "arrow" / file_name(parquet.stem, f"-{key.hexdigest()[:16]}.arrow")
    check = target.with_name(target.name + ".crc")
    # (A link there is not our copy: never read or replaced.)
    if refuse_link(target).is_file() and _matches(target, refuse_link(check)):
        return target
    try:
        _convert(parquet, target)
        with atomic_path(check) as tmp:
            tmp.write_text(f"{target.stat().st_size} {_crc32(target)}\n", encoding="ascii")
    except OSError as err:
        raise DataError(
            f"data: cannot write the Arrow copy of '{parquet}' into '{target.parent}': "
            f"{err.strerror or err}; set GLASSLOOP_CACHE_DIR to a writable folder (or free "
            "space there)"
        ) from err
    return target


def _convert(parquet: Path, target: Path) -> None:
    """Write the Arrow copy, a row group at a time, verifying page checksums where the file
    has them; a row group that cannot be decoded is one line naming it."""
    import pyarrow as pa

    try:
        source = _pyarrow().ParquetFile(parquet, page_checksum_verification=True)
    except Exception as err:  # pyarrow's own errors for a file that is not Parquet
        raise DataError(f"data: '{parquet}' is not a readable Parquet file: {err}") from err
    try:
        with (
            atomic_path(target) as tmp,
            pa.OSFile(str(tmp), "wb") as sink,
            pa.ipc.new_file(sink, source.schema_arrow) as out,
        ):
            # One row group at a time: iter_batches() over the whole file kept every decoded
            # page in Arrow's memory pool until the reader was gone (533 MB for 0.5 GB).
            for group in range(source.num_row_groups):
                try:
                    table = source.read_row_group(group)
                except (pa.ArrowException, OSError, ValueError, EOFError) as err:
                    first = str(err).splitlines()[0] if str(err) else type(err).__name__
                    raise DataError(
                        f"data: '{parquet}' row group {group} cannot be decoded ({first}): "
                        "the file is damaged"
                    ) from err
                out.write_table(table)
    finally:
        source.close()
    pa.default_memory_pool().release_unused()  # give the conversion's buffers back


def _matches(copy: Path, check: Path) -> bool:
    """Whether the Arrow copy has the size and CRC-32 recorded when it was written."""
    try:
        size, crc = check.read_text(encoding="ascii").split()
        return copy.stat().st_size == int(size) and _crc32(copy) == int(crc)
    except (OSError, ValueError):
        return False


def _crc32(path: Path) -> int:
    import zlib

    crc = 0
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 23), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def open_arrow(path: Path) -> Any:
    """The memory-mapped, zero-copy table of an Arrow IPC file."""
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def parquet_splits(
    path: str,
    *,
    label_column: str,
    image_column: str,
    image_size: int,
    channels: int,
    val_fraction: float,
    seed: int,
) -> tuple[ParquetRows, ParquetRows, dict[str, Any], list[str]]:
    """Training and validation rows of one Parquet file (a seeded random split), the
    preprocessing to save with the weights, and the class names. Only the label column (and,
    for numeric features, their columns) is read here, column by column."""
    file, arrow = _checked(path, [label_column, *([image_column] if image_column else [])])
    schema = _schema(file)
    labels, classes = _labels(open_arrow(arrow), label_column, file)
    train_idx, val_idx = _split(len(labels), val_fraction, seed)
    if image_column:
        first = open_arrow(arrow).column(image_column)[0].as_py()
        shape = probe_shape(first, channels, image_size)
        mean, std = _image_stats(arrow, image_column, train_idx, shape, seed)
        features: list[str] = []
        preprocessing = {"scale": 1 / 255, "mean": mean, "std": std, "image_shape": list(shape)}
    else:
        numeric = [f.name for f in schema if f.name != label_column and _numeric(f.type)]
        if not numeric:
            raise DataError(f"data: '{file}' has no numeric feature columns besides the label")
        table = open_arrow(arrow)
        values = np.column_stack([_finite(table, c, file) for c in numeric])[train_idx]
        std_values = values.std(axis=0)
        std_values[std_values == 0] = 1.0
        mean, std = values.mean(axis=0).tolist(), std_values.tolist()
        features, shape = numeric, (1, 0, 0)
        preprocessing = {"feature_columns": numeric, "mean": mean, "std": std}
    common: dict[str, Any] = {
        "features": features,
        "image_column": image_column,
        "image_shape": shape,
        "mean": mean,
        "std": std,
    }
    return (
        ParquetRows(arrow, train_idx, labels, **common),
        ParquetRows(arrow, val_idx, labels, **common),
        preprocessing,
        classes,
    )


def input_kind(path: str, *, label_column: str, image_column: str, text_column: str) -> str:
    """What a Parquet file's rows give the model: ``"image"`` (``image_column`` set),
    ``"text"`` (a string column named ``text_column``), else ``"numeric"`` (every numeric
    column but the label). A file with both a text column and numeric feature columns is
    refused: which one is meant is not for glassloop to guess."""
    if image_column:
        return "image"
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data: file '{file}' not found (data.path, a .parquet file)")
    import pyarrow.types as pt  # type: ignore[import-untyped]

    schema = _schema(file)
    text = text_column in schema.names and (
        pt.is_string(schema.field(text_column).type)
        or pt.is_large_string(schema.field(text_column).type)
    )
    numeric = [f.name for f in schema if f.name != label_column and _numeric(f.type)]
    if text and numeric:
        raise DataError(
            f"data: '{file}' has a text column {text_column!r} and numeric columns "
            f"({', '.join(numeric[:5])}); train on the text: drop the numeric columns; on the "
            "numbers: set data.text_column = ''"
        )
    return "text" if text else "numeric"


def _schema(file: Path) -> Any:
    try:
        return _pyarrow().read_schema(file)
    except Exception as err:  # pyarrow's own errors for a file that is not Parquet
        raise DataError(f"data: '{file}' is not a readable Parquet file: {err}") from err


def _checked(path: str, columns: list[str]) -> tuple[Path, Path]:
    """The Parquet file (checked to exist and to have ``columns``) and its Arrow copy."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data: file '{file}' not found (data.path, a .parquet file)")
    names = list(_schema(file).names)
    for column in columns:
        if column not in names:
            raise DataError(f"data: '{file}' has no column {column!r}; columns: {', '.join(names)}")
    return file, arrow_copy(file)  # the copy: what every process reads rows from


def _split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation row indices: a seeded random split, each sorted."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, round(val_fraction * n))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def _image_stats(
    arrow: Path, column: str, rows: np.ndarray, shape: tuple[int, int, int], seed: int
) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of a seeded sample of the training images."""
    images = open_arrow(arrow).column(column)
    sample = rows[stats_sample(len(rows), seed)]
    return channel_stats([read_image(images[int(i)].as_py(), shape) for i in sample])


def parquet_texts(
    path: str,
    *,
    label_column: str,
    text_column: str,
    tokenizer: str,
    vocab_size: int,
    max_length: int,
    val_fraction: float,
    seed: int,
) -> TextData:
    """Training and validation texts of one Parquet file (a seeded random split) with their
    tokenizer: ``tokenizer`` (a ``tokenizer.json``) or one trained on the training texts,
    streamed from the memory-mapped file a chunk at a time. The texts stay on disk; only the
    labels and each text's token count (for length buckets) are kept in memory."""
    file, arrow = _checked(path, [label_column, text_column])
    table = open_arrow(arrow)
    column = table.column(text_column)
    if column.null_count:
        raise DataError(
            f"data: '{file}' column {text_column!r} has {column.null_count} missing texts"
        )
    labels, classes = _labels(table, label_column, file)
    train_idx, val_idx = _split(len(labels), val_fraction, seed)
    _check_utf8(column, text_column, file)
    tokenizer_json = tokenizer_for(tokenizer, _chunks(column, train_idx), vocab_size)
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_str(tokenizer_json)
    pad = encoder.token_to_id(PAD)
    pad_id = 0 if pad is None else int(pad)
    common: dict[str, Any] = {
        "column": text_column,
        "tokenizer_json": tokenizer_json,
        "max_length": max_length,
        "pad_id": pad_id,
    }
    sets = []
    for rows in (train_idx, val_idx):
        lengths = [
            min(len(e.ids), max_length) or 1
            for texts in _chunks(column, rows)
            for e in encoder.encode_batch(texts)
        ]
        sets.append(ParquetTexts(arrow, rows, labels, lengths=lengths, **common))
    return TextData(
        sets[0],
        sets[1],
        encoder.get_vocab_size(),
        pad_id,
        len(classes),
        classes,
        tokenizer_json,
        max_length,
    )


def _chunks(column: Any, rows: np.ndarray, size: int = 8192) -> Iterator[list[str]]:
    """The texts of ``rows``, ``size`` at a time (memory: one chunk)."""
    for start in range(0, len(rows), size):
        yield column.take(rows[start : start + size]).to_pylist()


def _labels(table: Any, column: str, file: Path) -> tuple[np.ndarray, list[str]]:
    """The label column as class indices, and the class names; a file with fewer than two
    rows (one to train on, one to validate) is refused here."""
    if table.num_rows < 2:
        raise DataError(
            f"data: '{file}' has {table.num_rows} row(s); training needs at least two (one "
            "to train on, one to validate)"
        )
    values = table.column(column)
    _check_utf8(values, column, file)
    return _class_indices(values.to_pylist(), column, file)


def _finite(table: Any, column: str, file: Path) -> np.ndarray:
    """A numeric feature column as float64, every value present and finite (as the CSV
    reader requires): a null or a NaN is one line naming the column and the row."""
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    values = table.column(column)
    if values.null_count:
        row = int(np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))[0])
        raise DataError(
            f"data: '{file}' column {column!r} row {row}: a missing value (null); features "
            "must be numbers: fill or drop the missing values first"
        )
    numbers: np.ndarray = np.asarray(values.to_numpy(), dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(numbers))
    if bad.size:
        raise DataError(
            f"data: '{file}' column {column!r} row {int(bad[0])}: {numbers[bad[0]]} (NaN or "
            "infinite); features must be finite numbers: clean the column first"
        )
    return numbers


def _check_utf8(column: Any, name: str, file: Path) -> None:
    """Text that decodes: Parquet does not check that a string column holds UTF-8, and a
    bad row used to fail with a traceback in the middle of training."""
    try:
        column.validate(full=True)
    except Exception:  # pyarrow's ArrowInvalid: find the row for the message
        for row in range(len(column)):
            try:
                column[row].as_py()
            except (UnicodeDecodeError, ValueError):
                raise DataError(
                    f"data: '{file}' column {name!r} row {row}: bytes that are not UTF-8 "
                    "text; re-encode the column as UTF-8"
                ) from None
        raise


def _numeric(kind: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind))


def _class_indices(values: list[Any], column: str, file: Path) -> tuple[np.ndarray, list[str]]:
    """Integer labels as they are; strings sorted into class indices; anything else refused."""
    if any(v is None for v in values):
        raise DataError(f"data: '{file}' column {column!r} has missing labels")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise DataError(f"data: '{file}' labels must be class indices >= 0")
        where = f"'{file}' column {column!r}"
        classes = check_class_count(max(values), len(values), where)  # before anything is built
        return np.asarray(values, dtype=np.int64), [str(c) for c in range(classes)]
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        return np.asarray([index[v] for v in values], dtype=np.int64), names
    raise DataError(
        f"data: '{file}' column {column!r} holds {type(values[0]).__name__} values, not class "
        "labels (integers or strings)"
    )
