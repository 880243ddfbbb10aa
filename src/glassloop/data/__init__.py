"""Datasets and loaders."""

from glassloop.data.datasets import Splits, load_splits
from glassloop.data.loaders import ResumableLoader, make_loaders

__all__ = ["ResumableLoader", "Splits", "load_splits", "make_loaders"]
