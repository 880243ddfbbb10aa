"""Datasets and loaders."""

from glassloop.data.collate import pad_collate
from glassloop.data.datasets import load_splits
from glassloop.data.loaders import (
    BucketBatchSampler,
    InMemoryLoader,
    ResumableLoader,
    loaders_for_splits,
    make_loader,
)
from glassloop.data.splits import Splits

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
