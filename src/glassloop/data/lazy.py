"""Data sets read from disk row by row, in the loader's worker processes, instead of decoded
into memory up front: a folder of images too large for memory (``image-folder`` above
``data.in_memory_mb``) and tables of columns (Parquet shards, :mod:`glassloop.data.shards`;
a Hugging Face dataset, :mod:`glassloop.data.hf_datasets`).

A dataset here is map-style (a length and ``__getitem__``), so order, DDP sharding and exact
resume are :class:`~glassloop.data.loaders.ResumableLoader`'s, as for any dataset; it pickles
as paths and indices, never as decoded data.

What a table's columns give the model (:func:`input_kind`): the numeric columns but the label
(standardised with the training rows' statistics), one ``image_column`` of encoded image
bytes (PNG/JPEG, decoded in the worker, scaled to [0, 1] and standardised per channel), or
one ``text_column`` of strings (tokenized in the worker); the target is ``label_column``
(integer class indices or strings).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from glassloop.data.raw_files import open_image
from glassloop.errors import DataError

if TYPE_CHECKING:
    from glassloop.data.options import DataConfig
    from glassloop.data.text import TextData

STATS_ROWS = 10_000  # training rows the statistics and the tokenizer are taken from (at most)


class DiskData:
    """A data set on disk as the rest of glassloop sees one: training and validation
    datasets (each with a ``labels`` tensor), the classes, the input shape, and the
    preprocessing saved with the weights (so ``predict`` reads raw inputs the same way)."""

    def __init__(
        self,
        train: Any,
        val: Any,
        preprocessing: dict[str, Any],
        class_names: list[str],
        input_shape: tuple[int, ...],
    ) -> None:
        self.train, self.val, self.preprocessing = train, val, preprocessing
        self.class_names, self.input_shape = class_names, input_shape
        self.num_classes = len(class_names)


class ImageFiles(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Image files decoded on demand: resized to ``shape`` ``(C, H, W)``, scaled to [0, 1],
    standardised per channel with ``mean``/``std``."""

    def __init__(
        self,
        files: list[Path],
        labels: np.ndarray,
        shape: tuple[int, int, int],
        mean: list[float],
        std: list[float],
    ) -> None:
        self.files = list(files)
        self.labels = torch.as_tensor(labels, dtype=torch.int64)
        self.shape = shape
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = read_image(self.files[index], self.shape)
        return (image - self.mean) / self.std, self.labels[index]


def read_image(source: Path | bytes, shape: tuple[int, int, int]) -> torch.Tensor:
    """An image file (or its encoded bytes) as a float tensor ``(C, H, W)`` in [0, 1],
    resized to ``shape`` (a height of 0 keeps the image's size)."""
    channels, height, width = shape
    with open_image(source, "data") as opened:
        image = opened.convert("L" if channels == 1 else "RGB")
    if height and (image.height, image.width) != (height, width):
        image = image.resize((width, height))
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.reshape(pixels.shape[0], pixels.shape[1], -1)).permute(2, 0, 1)


def probe_shape(source: Path | bytes, channels: int, size: int) -> tuple[int, int, int]:
    """``(C, H, W)``: ``channels`` and ``size`` (a square) when given, else the image's own."""
    with open_image(source, "data") as opened:
        channels = channels or (1 if opened.mode in ("L", "1", "I", "I;16") else 3)
        height, width = (size, size) if size else opened.size[::-1]
    return channels, height, width


def stats_sample(count: int, seed: int) -> np.ndarray:
    """The positions of up to 1,000 of ``count`` images (seeded) that give the statistics."""
    return np.random.default_rng(seed).choice(count, size=min(1000, count), replace=False)


def channel_stats(images: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of a sample of images (see :func:`stats_sample`)."""
    stacked = torch.stack(images)
    std = stacked.std(dim=(0, 2, 3))
    std[std == 0] = 1.0
    return stacked.mean(dim=(0, 2, 3)).tolist(), std.tolist()


def input_kind(
    schema: Any, shown: str, label: str, image_column: str, text_column: str
) -> tuple[str, list[str]]:
    """What the rows give the model and from which columns: ``"image"`` (``image_column``
    set), ``"text"`` (a string column named ``text_column``), else ``"numeric"`` (every
    numeric column but the label). A table with both a text column and numeric feature
    columns is refused: which one is meant is not for glassloop to guess."""
    import pyarrow.types as pt  # type: ignore[import-untyped]

    if image_column:
        return "image", [image_column]
    kind = schema.field(text_column).type if text_column in schema.names else None
    text = kind is not None and (pt.is_string(kind) or pt.is_large_string(kind))
    numeric = [f.name for f in schema if f.name != label and _numeric(f.type)]
    if text and numeric:
        raise DataError(
            f"data: {shown} has a text column {text_column!r} and numeric columns "
            f"({', '.join(numeric[:5])}); train on the text: drop the numeric columns; on the "
            "numbers: set data.text_column = ''"
        )
    if text:
        return "text", [text_column]
    if not numeric:
        raise DataError(f"data: {shown} has no numeric feature columns besides the label")
    return "numeric", numeric


def check_values(column: Any, name: str, where: str, *, missing: str = "") -> None:
    """Numbers present and finite, texts present and UTF-8 (Parquet checks neither): a bad
    value is one line naming the column and its row, never a traceback mid-training."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    if column.null_count:
        row = int(np.flatnonzero(pc.is_null(column).to_numpy(zero_copy_only=False))[0])
        raise DataError(
            f"data: {where} column {name!r} row {row}: a missing value (null); "
            f"{missing or 'inputs'} must be present: fill or drop the missing values first"
        )
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:  # find the row for the message
            for row in range(len(column)):
                try:
                    column[row].as_py()
                except (UnicodeDecodeError, ValueError):
                    raise DataError(
                        f"data: {where} column {name!r} row {row}: bytes that are not UTF-8 "
                        "text; re-encode the column as UTF-8"
                    ) from None
            raise
    elif _numeric(column.type):
        numbers = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers))
        if bad.size:
            raise DataError(
                f"data: {where} column {name!r} row {int(bad[0])}: {numbers[bad[0]]} (NaN or "
                "infinite); features must be finite numbers: clean the column first"
            )


def _numeric(kind: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind))


class TableRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows of a table as ``(inputs, class)``; a subclass says where a batch's rows are
    (``__getitems__``) and hands them to :meth:`inputs`. ``kind``: :func:`input_kind`'s,
    ``preprocess``: what :func:`prepared` took from the training rows."""

    lengths = None  # (texts: no length buckets, they would need every text read first)
    labels: torch.Tensor

    def __init__(self, kind: str, columns: list[str]) -> None:
        self.kind, self.columns = kind, columns
        self.preprocess: dict[str, Any] = {}
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def inputs(self, part: Any) -> list[torch.Tensor]:
        """The model's inputs from ``part``, an Arrow table of the :attr:`columns`."""
        p = self.preprocess
        if self.kind == "numeric":
            values = np.column_stack([part.column(c).to_numpy() for c in self.columns])
            return list((torch.from_numpy(values.astype(np.float32)) - p["mean"]) / p["std"])
        if self.kind == "image":
            shape = tuple(p["image_shape"])
            mean, std = p["mean"][:, None, None], p["std"][:, None, None]
            return [(read_image(b, shape) - mean) / std for b in image_bytes(part.column(0))]
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(p["tokenizer_json"])
        cut, pad = p["max_length"], p["pad_id"]
        encoded = self._tokenizer.encode_batch(part.column(0).to_pylist())
        return [torch.tensor(e.ids[:cut] or [pad], dtype=torch.long) for e in encoded]


def image_bytes(column: Any) -> list[bytes]:
    """A binary column's images, or a Hugging Face ``Image`` column's (its bytes, else its
    file's)."""
    images = column.to_pylist()
    return [
        v if isinstance(v, bytes) else v["bytes"] or Path(v["path"]).read_bytes() for v in images
    ]


def prepared(
    d: DataConfig, sets: tuple[TableRows, TableRows], sample: Any, classes: list[str]
) -> DiskData | TextData:
    """The training and validation rows with their preprocessing, taken from ``sample`` (an
    Arrow table of up to :data:`STATS_ROWS` training rows' input columns): the features'
    mean and std, the images' shape and channel statistics, or the tokenizer (``data.
    tokenizer``, else trained on the sample's texts); saved with the weights."""
    from glassloop.data.text import PAD, TextData, tokenizer_for

    kind, inputs = sets[0].kind, sets[0].columns
    saved: dict[str, Any]
    if kind == "text":
        tokenizer_json = tokenizer_for(d.tokenizer, [sample.column(0).to_pylist()], d.vocab_size)
        from tokenizers import Tokenizer

        encoder = Tokenizer.from_str(tokenizer_json)
        pad_id = int(encoder.token_to_id(PAD) or 0)
        for rows in sets:
            rows.preprocess = {"tokenizer_json": tokenizer_json, "max_length": d.max_length}
            rows.preprocess["pad_id"] = pad_id
        named = (len(classes), classes, tokenizer_json, d.max_length)
        return TextData(sets[0], sets[1], encoder.get_vocab_size(), pad_id, *named)
    if kind == "image":
        images = image_bytes(sample.column(0))[:1000]
        image = probe_shape(images[0], d.channels, d.image_size)
        mean, std = channel_stats([read_image(b, image) for b in images])
        saved = {"scale": 1 / 255, "mean": mean, "std": std, "image_shape": list(image)}
        shape: tuple[int, ...] = image
    else:
        values = np.column_stack([sample.column(c).to_numpy() for c in inputs])
        spread = values.std(axis=0)
        spread[spread == 0] = 1.0
        saved = {"feature_columns": inputs, "mean": values.mean(0).tolist(), "std": spread.tolist()}
        shape = (len(inputs),)
    for rows in sets:
        rows.preprocess = {**saved}
        for key in ("mean", "std"):
            rows.preprocess[key] = torch.tensor(saved[key], dtype=torch.float32)
    return DiskData(sets[0], sets[1], saved, classes, shape)
