"""Datasets and loaders."""

from glassloop.data.datasets import Splits, load_splits
from glassloop.data.loaders import make_loaders

__all__ = ["Splits", "load_splits", "make_loaders"]
