"""The ``[data]`` section of a config: which data, where it is, how it is read and batched.
Owned here, torch-free, next to the loaders that read it, with each key's accepted values
(declared with :func:`glassloop.options.option`); :mod:`glassloop.config.schema` composes it."""

from __future__ import annotations

from dataclasses import dataclass, field

from glassloop.options import option
from glassloop.rules import AT_LEAST_0, Range

# The data a config can name (data.name).
DATASET_NAMES = (
    "mnist-5k",
    "digits",
    "synthetic",
    "npz",
    "csv",
    "image-folder",
    "mnist",
    "fashion-mnist",
    "cifar10",
    "text-csv",
    "parquet",
    "hf",
)


@dataclass
class DataConfig:
    """``name``: ``mnist-5k`` (bundled), ``digits`` (scikit-learn), ``synthetic``, ``npz``,
    ``csv`` (tabular), ``image-folder``, ``mnist``, ``fashion-mnist``, ``cifar10`` (files in
    ``root``), ``parquet`` (shards where they live), ``hf`` (a Hugging Face dataset's files);
    see docs/datasets.md."""

    name: str = option("mnist-5k", rule=DATASET_NAMES)
    """the data: one of the names above (docs/datasets.md)."""
    path: str = ""
    """npz, csv, text-csv, image-folder: the file or folder to read; parquet: a file, a folder,
    a glob or a URL prefix (``s3://bucket/train/``) of shards; hf: a folder ``save_to_disk``
    wrote, or Parquet/Arrow files (a file, a folder, a glob)."""
    root: str = "data"
    """mnist, fashion-mnist, cifar10: where their files are (or go)."""
    download: bool = False
    """mnist, fashion-mnist: fetch the files with torchvision (glassloop[vision])."""
    label_column: str = "label"
    """csv, text-csv, parquet, hf: the target column."""
    label_columns: list[str] = field(default_factory=list)
    """csv: several target columns (multilabel, several outputs)."""
    image_column: str = ""
    """parquet, hf: a column of encoded images (else: text or numbers)."""
    in_memory_mb: int = option(4096, rule=AT_LEAST_0)
    """image-folder: larger once decoded, images are read in workers."""
    image_size: int = option(0, rule=Range(0, 2**15))
    """image-folder: resize to this square size (0: keep; all must match)."""
    channels: int = option(0, rule=(0, 1, 3))
    """image-folder: 1 (grayscale) or 3 (RGB); 0: from the first image."""
    text_column: str = "text"
    """text-csv; parquet, hf: a string column of this name: texts."""
    tokenizer: str = ""
    """text-csv: a tokenizer.json to use instead of training one."""
    vocab_size: int = option(8000, rule=Range(2, 2**24))
    """text-csv: size of the tokenizer trained on the training texts."""
    max_length: int = option(256, rule=Range(1, 2**24))
    """text-csv: longer texts are cut."""
    bucket_by_length: bool = True
    """text-csv: batches of similar lengths (less padding)."""
    augment: list[str] = field(default_factory=list)
    """images, training only: "hflip", "crop"."""
    normalize: bool = True
    """images: standardise per channel; false: pixels in [0, 1] only."""
    standardize_targets: bool = False
    """regression: learn (y - mean) / std, report y's units."""
    batch_size: int = option(64, rule=Range(1, 2**31))
    """rows per training batch (per process)."""
    eval_batch_size: int = option(0, rule=Range(0, 2**31), resume_safe=True)
    """rows per validation batch (0: ``batch_size``)."""
    shuffle: bool = True
    """shuffle the training data each epoch (seeded)."""
    num_workers: int = option(0, rule=Range(0, 256), resume_safe=True)
    """loader worker processes (0: batches are made in the training process)."""
    val_fraction: float = option(0.2, rule=Range(0.0, 1.0, open_low=True, open_high=True))
    """the share held out for validation, for datasets without a fixed validation split."""
    val_path: str = ""
    """parquet, hf: the validation rows (as ``path``); empty: a seeded split of ``path``."""
    shuffle_window: int = option(8, rule=Range(1, 2**20))
    """parquet: row groups whose rows are shuffled together (order: docs/datasets.md)."""
    cache_mb: int = option(1024, rule=Range(1, 2**30), resume_safe=True)
    """parquet: local cache of decoded row groups, per process (read ahead, then evicted)."""
    val_sets: dict[str, str] = field(default_factory=dict)
    """npz: further validation sets by name (``{ood = "shifted.npz"}``: x and y, every row, or
    x_val and y_val), each reported as ``val_<name>_*``, monitorable like ``val_*``."""
    num_samples: int = option(2048, rule=Range(1, 2**40))
    """synthetic only: rows generated."""
    num_features: int = option(32, rule=Range(1, 2**24))
    """synthetic only: features per row."""
    num_classes: int = option(10, rule=Range(2, 2**24))
    """synthetic only: classes."""
    seed: int = option(0, rule=Range(0, 2**32 - 1))
    """split / generation seed, independent of ``train.seed``."""
