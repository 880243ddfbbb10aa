"""The ``[data]`` section of a config: which data, where it is, how it is read and batched.
Owned here, next to the loaders that read it; :mod:`glassloop.config` composes it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """``name``: ``mnist-5k`` (bundled), ``digits`` (scikit-learn), ``synthetic``, ``npz``,
    ``csv`` (tabular), ``image-folder``, ``mnist``, ``fashion-mnist``, ``cifar10`` (files in
    ``root``); see docs/datasets.md."""

    name: str = "mnist-5k"
    path: str = ""  # npz, csv, image-folder
    root: str = "data"  # mnist, fashion-mnist, cifar10: where their files are (or go)
    download: bool = False  # mnist, fashion-mnist: fetch with torchvision (glassloop[vision])
    label_column: str = "label"  # csv: the target column
    label_columns: list[str] = field(default_factory=list)  # csv: several (multilabel, outputs)
    image_column: str = ""  # parquet: a column of encoded images (else: text or numbers)
    in_memory_mb: int = 4096  # image-folder: larger once decoded, images are read in workers
    image_size: int = 0  # image-folder: resize to this square size (0: keep; all must match)
    channels: int = 0  # image-folder: 1 (grayscale) or 3 (RGB); 0: from the first image
    text_column: str = "text"  # text-csv; parquet: a string column of this name: texts
    tokenizer: str = ""  # text-csv: a tokenizer.json to use instead of training one
    vocab_size: int = 8000  # text-csv: size of the tokenizer trained on the training texts
    max_length: int = 256  # text-csv: longer texts are cut
    bucket_by_length: bool = True  # text-csv: batches of similar lengths (less padding)
    augment: list[str] = field(default_factory=list)  # images, training: "hflip", "crop"
    normalize: bool = True  # images: standardise per channel; false: pixels in [0, 1] only
    standardize_targets: bool = False  # regression: learn (y - mean) / std, report y's units
    batch_size: int = 64
    eval_batch_size: int = 0  # 0: same as batch_size
    shuffle: bool = True
    num_workers: int = 0
    val_fraction: float = 0.2  # for datasets without a fixed validation split
    # npz: further validation sets by name ({ood = "shifted.npz"}: x and y, every row, or
    # x_val and y_val), each reported as val_<name>_*, monitorable like val_*
    val_sets: dict[str, str] = field(default_factory=dict)
    num_samples: int = 2048  # synthetic only
    num_features: int = 32  # synthetic only
    num_classes: int = 10  # synthetic only
    seed: int = 0  # split / generation seed, independent of train.seed
