"""Datasets and loaders."""

from glassloop.data.collate import pad_collate
from glassloop.data.datasets import load_splits
from glassloop.data.loaders import (
    BucketBatchSampler,
    InMemoryLoader,
    ResumableLoader,
    make_loader,
    make_loaders,
)
from glassloop.data.splits import Splits

__all__ = [
    "BucketBatchSampler",
    "InMemoryLoader",
    "ResumableLoader",
    "Splits",
    "load_splits",
    "make_loader",
    "make_loaders",
    "pad_collate",
]
