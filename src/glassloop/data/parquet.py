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
statistics) or one ``image_column`` of encoded image bytes (PNG/JPEG, decoded in the worker,
scaled to [0, 1] and standardised per channel); the target is ``label_column`` (integer
class indices or strings). Order, sharding and exact resume are :class:`ResumableLoader`'s,
as for every map-style dataset: per-epoch seeded order, position in batches, no global RNG.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from glassloop.data.lazy import channel_stats, probe_shape, read_image, stats_sample
from glassloop.errors import DataError


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError as err:
        raise DataError(
            "data: data.name = 'parquet' needs pyarrow: pip install 'glassloop[parquet]'"
        ) from err
    return pq


class ParquetRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
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
        self.path = Path(path)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.labels = torch.as_tensor(np.asarray(labels)[self.indices], dtype=torch.int64)
        self.features = features
        self.image_column = image_column
        self.image_shape = image_shape
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self._table: Any = None  # the memory-mapped table, opened in the process that reads

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}  # workers open the file themselves

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is None:
            self._table = open_arrow(self.path)
        row = self._table.slice(int(self.indices[index]), 1).to_pylist()[0]
        if self.image_column:
            x = read_image(row[self.image_column], self.image_shape)
            x = (x - self.mean[:, None, None]) / self.std[:, None, None]
        else:
            x = torch.tensor([row[c] for c in self.features], dtype=torch.float32) - self.mean
            x = x / self.std
        return x, self.labels[index]


def arrow_copy(parquet: Path) -> Path:
    """The uncompressed Arrow IPC copy of ``parquet`` in the cache directory, written once
    (a row group at a time: memory is bounded by the largest row group) and atomically."""
    import hashlib

    import pyarrow as pa

    from glassloop.data.datasets import cache_dir

    stat = parquet.stat()
    key = hashlib.sha256(f"{parquet.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    target = cache_dir() / "arrow" / f"{parquet.stem}-{key.hexdigest()[:16]}.arrow"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    source = _pyarrow().ParquetFile(parquet)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, source.schema_arrow) as out:
            # One row group at a time: iter_batches() over the whole file kept every decoded
            # page in Arrow's memory pool until the reader was gone (533 MB for 0.5 GB).
            for group in range(source.num_row_groups):
                out.write_table(source.read_row_group(group))
    finally:
        source.close()
    pa.default_memory_pool().release_unused()  # give the conversion's buffers back
    tmp.replace(target)
    return target


def open_arrow(path: Path) -> Any:
    """The memory-mapped, zero-copy table of an Arrow IPC file."""
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def parquet_splits(
    path: str, *, label_column: str, image_column: str, image_size: int, channels: int,
    val_fraction: float, seed: int,
) -> tuple[ParquetRows, ParquetRows, dict[str, Any], list[str]]:  # fmt: skip
    """Training and validation rows of one Parquet file (a seeded random split), the
    preprocessing to save with the weights, and the class names. Only the label column (and,
    for numeric features, their columns) is read here, column by column."""
    pq = _pyarrow()
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data: file '{file}' not found (data.path, a .parquet file)")
    try:
        schema = pq.read_schema(file)
    except Exception as err:  # pyarrow's own errors for a file that is not Parquet
        raise DataError(f"data: '{file}' is not a readable Parquet file: {err}") from err
    names = list(schema.names)
    for column in [label_column, *([image_column] if image_column else [])]:
        if column not in names:
            raise DataError(f"data: '{file}' has no column {column!r}; columns: {', '.join(names)}")
    arrow = arrow_copy(file)  # what every process reads rows from
    raw = open_arrow(arrow).column(label_column).to_pylist()
    labels, classes = _class_indices(raw, label_column, file)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = max(1, round(val_fraction * len(labels)))
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
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
        values = np.column_stack([table.column(c).to_numpy() for c in numeric])[train_idx]
        std_values = values.std(axis=0)
        std_values[std_values == 0] = 1.0
        mean, std = values.mean(axis=0).tolist(), std_values.tolist()
        features, shape = numeric, (1, 0, 0)
        preprocessing = {"feature_columns": numeric, "mean": mean, "std": std}
    common: dict[str, Any] = {
        "features": features, "image_column": image_column, "image_shape": shape,
        "mean": mean, "std": std,
    }  # fmt: skip
    return (
        ParquetRows(arrow, train_idx, labels, **common),
        ParquetRows(arrow, val_idx, labels, **common),
        preprocessing,
        classes,
    )


def _image_stats(
    arrow: Path, column: str, rows: np.ndarray, shape: tuple[int, int, int], seed: int
) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of a seeded sample of the training images."""
    images = open_arrow(arrow).column(column)
    sample = rows[stats_sample(len(rows), seed)]
    return channel_stats([read_image(images[int(i)].as_py(), shape) for i in sample])


def _numeric(kind: Any) -> bool:
    import pyarrow.types as pt  # type: ignore[import-untyped]

    return bool(pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind))


def _class_indices(values: list[Any], column: str, file: Path) -> tuple[np.ndarray, list[str]]:
    """Integer labels as they are; strings sorted into class indices; anything else refused."""
    if any(v is None for v in values):
        raise DataError(f"data: '{file}' column {column!r} has missing labels")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        labels = np.asarray(values, dtype=np.int64)
        if labels.min() < 0:
            raise DataError(f"data: '{file}' labels must be class indices >= 0")
        return labels, [str(c) for c in range(int(labels.max()) + 1)]
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        return np.asarray([index[v] for v in values], dtype=np.int64), names
    raise DataError(
        f"data: '{file}' column {column!r} holds {type(values[0]).__name__} values, not class "
        "labels (integers or strings)"
    )
