"""Data sets read from disk row by row, in the loader's worker processes, instead of decoded
into memory up front: a folder of images too large for memory (``image-folder`` above
``data.in_memory_mb``) and Parquet tables (:mod:`glassloop.data.parquet`).

A dataset here is map-style (a length and ``__getitem__``), so order, DDP sharding and exact
resume are :class:`~glassloop.data.loaders.ResumableLoader`'s, as for any dataset; it pickles
as paths and indices, never as decoded data.
"""

from __future__ import annotations

import contextlib
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
        self, train: Any, val: Any, preprocessing: dict[str, Any], class_names: list[str],
        input_shape: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.train, self.val = train, val
        self.preprocessing = preprocessing
        self.class_names = class_names
        self.num_classes = len(class_names)
        self.input_shape = input_shape


class ImageFiles(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Image files decoded on demand: resized to ``shape`` ``(C, H, W)``, scaled to [0, 1],
    standardised per channel with ``mean``/``std``."""

    def __init__(
        self, files: list[Path], labels: np.ndarray, shape: tuple[int, int, int],
        mean: list[float], std: list[float],
    ) -> None:  # fmt: skip
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


def read_image(path: Path, shape: tuple[int, int, int]) -> torch.Tensor:
    """One image file as a float tensor ``(C, H, W)`` in [0, 1], resized to ``shape``."""
    channels, height, width = shape
    with open_image(path, "data") as opened:
        image = opened.convert("L" if channels == 1 else "RGB")
    if (image.height, image.width) != (height, width):
        image = image.resize((width, height))
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.reshape(height, width, channels)).permute(2, 0, 1)


@contextlib.contextmanager
def open_image(path: Path, who: str) -> Iterator[Any]:
    """Pillow's ``Image.open``, with every way an image file can fail (unreadable, not an
    image, a decompression bomb: a small file that claims billions of pixels) turned into
    one :class:`DataError` line. Pillow only warns between 89M and 179M pixels; here that
    is an error too."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                yield opened
    except (OSError, Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise DataError(f"{who}: cannot read image '{path}': {err}") from err


def channel_stats(
    files: list[Path], shape: tuple[int, int, int], seed: int
) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of up to 1,000 of ``files`` (a seeded sample)."""
    rng = np.random.default_rng(seed)
    sample = rng.choice(len(files), size=min(1000, len(files)), replace=False)
    images = torch.stack([read_image(files[int(i)], shape) for i in sample])
    std = images.std(dim=(0, 2, 3))
    std[std == 0] = 1.0
    return images.mean(dim=(0, 2, 3)).tolist(), std.tolist()
