"""Datasets and loaders.

The names below are imported when first used (PEP 562), so that a module of this package
that needs no torch (``glassloop.data.options``, the ``[data]`` section a config reads) loads
none: importing it runs this file first.

>>> import glassloop.data
>>> glassloop.data.make_loader.__module__
'glassloop.data.loaders'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it.
_EXPORTS = {
    "BucketBatchSampler": "glassloop.data.loaders",
    "InMemoryLoader": "glassloop.data.loaders",
    "ResumableLoader": "glassloop.data.loaders",
    "Splits": "glassloop.data.splits",
    "load_splits": "glassloop.data.datasets",
    "loaders_for_splits": "glassloop.data.loaders",
    "make_loader": "glassloop.data.loaders",
    "pad_collate": "glassloop.data.text",
}

__all__ = [
    "BucketBatchSampler",
    "InMemoryLoader",
    "ResumableLoader",
    "Splits",
    "load_splits",
    "loaders_for_splits",
    "make_loader",
    "pad_collate",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glassloop.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from glassloop.data.datasets import load_splits
    from glassloop.data.loaders import (
        BucketBatchSampler,
        InMemoryLoader,
        ResumableLoader,
        loaders_for_splits,
        make_loader,
    )
    from glassloop.data.splits import Splits
    from glassloop.data.text import pad_collate
