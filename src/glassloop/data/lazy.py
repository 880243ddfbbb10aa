"""Data sets read from disk row by row, in the loader's worker processes, instead of decoded
into memory up front: a folder of images too large for memory (``image-folder`` above
``data.in_memory_mb``) and Parquet tables (:mod:`glassloop.data.parquet`).

A dataset here is map-style (a length and ``__getitem__``), so order, DDP sharding and exact
resume are :class:`~glassloop.data.loaders.ResumableLoader`'s, as for any dataset; it pickles
as paths and indices, never as decoded data.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from glassloop.errors import DataError


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
        self.train, self.val = train, val
        self.preprocessing = preprocessing
        self.class_names = class_names
        self.num_classes = len(class_names)
        self.input_shape = input_shape


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
        return (read_image(self.files[index], self.shape) - self.mean) / self.std, self.labels[
            index
        ]


def read_image(source: Path | bytes, shape: tuple[int, int, int]) -> torch.Tensor:
    """An image file (or its encoded bytes) as a float tensor ``(C, H, W)`` in [0, 1],
    resized to ``shape`` (a height of 0 keeps the image's size)."""
    channels, height, width = shape
    opened_from = io.BytesIO(source) if isinstance(source, bytes) else source
    with open_image(opened_from, "data") as opened:
        image = opened.convert("L" if channels == 1 else "RGB")
    if height and (image.height, image.width) != (height, width):
        image = image.resize((width, height))
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.reshape(pixels.shape[0], pixels.shape[1], -1)).permute(2, 0, 1)


@contextlib.contextmanager
def open_image(path: Path | io.BytesIO, who: str) -> Iterator[Any]:
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
            with Image.open(path) as opened:
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
        name = "image bytes" if isinstance(path, io.BytesIO) else f"image '{path}'"
        raise DataError(f"{who}: cannot read {name}: {err}") from err


def probe_shape(source: Path | bytes, channels: int, size: int) -> tuple[int, int, int]:
    """``(C, H, W)``: ``channels`` and ``size`` (a square) when given, else the image's own."""
    opened_from = io.BytesIO(source) if isinstance(source, bytes) else source
    with open_image(opened_from, "data") as opened:
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
