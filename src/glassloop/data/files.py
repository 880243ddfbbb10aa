"""Datasets read from files: tabular CSV, a folder of images, MNIST/Fashion-MNIST (IDX files)
and CIFAR-10 (binary batches). Everything is decoded once into in-memory tensors (the fast
path); the statistics used to normalise come from the training split only and travel with
the weights (``Splits.preprocessing``).

Readers are hand-written because the formats are a few lines each and the usual readers
either unpickle (CIFAR-10's python batches) or need torchvision, which is optional here.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from glassloop.data.lazy import probe_shape
from glassloop.data.options import DataConfig
from glassloop.data.raw_files import IMAGE_SUFFIXES, is_float, open_image, read_csv_rows
from glassloop.data.splits import (
    Splits,
    check_class_count,
    from_arrays,
    stratified_split,
    target_values,
)
from glassloop.errors import DataError

if TYPE_CHECKING:
    from glassloop.data.lazy import DiskData

# Per-dataset pixel statistics (training sets, pixels in [0, 1]).
STATS = {
    "mnist": ([0.1307], [0.3081]),
    "fashion-mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
}


def _class_indices(labels: list[str], column: str, path: Path) -> tuple[np.ndarray, list[str]]:
    """Integer labels stay numbers (0..max); words become sorted class names; real numbers
    are refused (a regression read as classes would train on string-sorted "classes")."""
    try:
        numbers = [int(v) for v in labels]
    except ValueError:
        real = [v for v in labels if is_float(v)]
        if len(real) == len(labels):
            raise DataError(
                f"data: '{path}' column {column!r} holds real numbers (e.g. {real[0]!r}), not "
                "class labels; for a regression set loss.name = 'mse' (or train.task = "
                "'regression')"
            ) from None
        names = sorted(set(labels))
        index = {name: i for i, name in enumerate(names)}
        return np.array([index[v] for v in labels], dtype=np.int64), names
    if min(numbers) < 0:
        raise DataError(f"data: labels must be class indices >= 0, found {min(numbers)}")
    classes = check_class_count(max(numbers), len(numbers), f"'{path}' column {column!r}")
    return np.array(numbers, dtype=np.int64), [str(c) for c in range(classes)]


def tabular_csv(cfg: DataConfig, task: str = "classification") -> Splits:
    """A CSV with a header: ``label_column`` (or ``label_columns``) holds the target — a
    class for classification, numbers for a regression, 0/1 per column for multilabel —
    and every other column is a numeric feature, standardised with the training split's
    mean and standard deviation."""
    path = _existing(cfg.path, "data.path (a .csv file)")
    rows = read_csv_rows(path)
    if len(rows) < 2:
        raise DataError(f"data: '{path}' has no data rows (a header and at least one row)")
    header, body = rows[0], rows[1:]
    targets = cfg.label_columns or [cfg.label_column]
    key = "data.label_columns" if cfg.label_columns else "data.label_column"
    missing = [name for name in targets if name not in header]
    if missing:
        raise DataError(
            f"data: '{path}' has no column {missing[0]!r} ({key}); columns: {', '.join(header)}"
        )
    labels = task in ("classification", "language-model")
    if labels and len(targets) > 1:
        raise DataError(
            f"data: {len(targets)} label columns for a classification (one class per row); "
            "for several 0/1 tags set loss.name = 'bce_with_logits' (multilabel)"
        )
    target_at = [header.index(name) for name in targets]
    features = [name for i, name in enumerate(header) if i not in target_at]
    x = np.empty((len(body), len(features)), dtype=np.float32)
    raw_targets: list[list[str]] = []
    for r, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise DataError(
                f"data: '{path}' line {r} has {len(row)} fields, the header {len(header)}"
            )
        values = [v for i, v in enumerate(row) if i not in target_at]
        try:
            x[r - 2] = [float(v) for v in values]
        except ValueError:
            bad = next(i for i, v in enumerate(values) if not is_float(v))
            raise DataError(
                f"data: '{path}' line {r}, column {features[bad]!r}: {values[bad]!r} is not a "
                "number (features must be numeric; encode categories first)"
            ) from None
        raw_targets.append([row[i] for i in target_at])
    if not np.isfinite(x).all():
        raise DataError(f"data: '{path}' has NaN or infinite feature values")
    names: list[str]
    if labels:
        y, names = _class_indices([t[0] for t in raw_targets], targets[0], path)
    else:
        bad_row = next((n for n, t in enumerate(raw_targets) if not all(map(is_float, t))), None)
        if bad_row is not None:
            raise DataError(
                f"data: '{path}' line {bad_row + 2}: the {task} targets "
                f"{raw_targets[bad_row]} are not all numbers"
            )
        y, names = (
            target_values(np.array(raw_targets, dtype=np.float64), task, f"'{path}'"),
            targets,
        )
    x_tr, y_tr, x_va, y_va = stratified_split(
        x, y, val_size=cfg.val_fraction, seed=cfg.seed, stratify=labels
    )
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    std[std == 0] = 1.0  # a constant column stays constant instead of dividing by zero
    scale = {"feature_columns": features, "mean": mean.tolist(), "std": std.tolist()}
    return from_arrays(
        (x_tr - mean) / std, y_tr, (x_va - mean) / std, y_va, names, scale, values=not labels
    )


def _existing(path: str, what: str) -> Path:
    if not path:
        raise DataError(f"data: set {what}")
    resolved = Path(path)
    if not resolved.exists():
        raise DataError(f"data: '{resolved}' not found ({what})")
    return resolved


Listing = tuple[list[Path], np.ndarray]  # image files and their class indices


def image_listing(cfg: DataConfig) -> tuple[list[str], list[Listing]]:
    """The class names and the image files with their labels: ``data.path/<class>/<image>``;
    ``[train, val]`` when ``train/`` and ``val/`` subfolders are the split, else one listing
    of everything (split by :func:`stratified_split`: ``val_fraction`` of each class held out,
    seeded). Nothing is decoded here."""
    root = _existing(cfg.path, "data.path (a folder with one sub-folder per class)")
    parts = [root / "train", root / "val"]
    fixed_split = all(p.is_dir() for p in parts)
    class_root = parts[0] if fixed_split else root
    names = sorted(p.name for p in class_root.iterdir() if p.is_dir())
    if not names:
        raise DataError(f"data: '{class_root}' has no class sub-folders (<class>/<image>.png)")

    def listed(folder: Path) -> Listing:
        files, labels = [], []
        for label, name in enumerate(names):
            for file in sorted((folder / name).iterdir()) if (folder / name).is_dir() else []:
                if file.suffix.lower() in IMAGE_SUFFIXES:
                    if not file.is_file():  # a worker would block on a FIFO for good
                        raise DataError(
                            f"data: '{file}' is not a regular file (a folder, a FIFO, a "
                            "device or a link to nothing); move it out of the image folder"
                        )
                    files.append(file)
                    labels.append(label)
        if not files:
            raise DataError(
                f"data: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under '{folder}'"
            )
        return files, np.array(labels, dtype=np.int64)

    return names, [listed(parts[0]), listed(parts[1])] if fixed_split else [listed(root)]


def image_shape(cfg: DataConfig, first: Path) -> tuple[int, int, int]:
    """``(C, H, W)``: channels and size from the config, else from the first image."""
    return probe_shape(first, cfg.channels, cfg.image_size)


def image_folder(cfg: DataConfig) -> Splits:
    """The ``image-folder`` data set (:func:`image_listing`) decoded into memory with Pillow
    (no torchvision needed), resized to ``image_size``, normalised per channel with the
    training split's statistics."""
    names, listings = image_listing(cfg)
    channels = image_shape(cfg, listings[0][0][0])[0]  # (from the first file listed)

    def decoded(files: list[Path]) -> np.ndarray:
        images = []
        for file in files:
            with open_image(file, "data") as opened:
                image = opened.convert("L" if channels == 1 else "RGB")
                if cfg.image_size:
                    image = image.resize((cfg.image_size, cfg.image_size))
                pixels = np.asarray(image, dtype=np.uint8)
            images.append(pixels.reshape(pixels.shape[0], pixels.shape[1], channels))
        shapes = {im.shape for im in images}
        if len(shapes) > 1:
            raise DataError(
                f"data: images under '{cfg.path}' have different sizes {sorted(shapes)[:3]}...; "
                "set data.image_size to resize them"
            )
        return np.stack(images).transpose(0, 3, 1, 2)

    if len(listings) == 2:
        (train, y_tr), (val, y_va) = listings
        x_tr, x_va = decoded(train), decoded(val)
    else:  # every image decoded (each one's errors first), then split
        (every, labels) = listings[0]
        x_tr, y_tr, x_va, y_va = stratified_split(
            decoded(every), labels, val_size=cfg.val_fraction, seed=cfg.seed
        )
    return _normalised(x_tr, y_tr, x_va, y_va, names, None if cfg.normalize else _unit(x_tr))


def image_folder_on_disk(cfg: DataConfig) -> DiskData | None:
    """The ``image-folder`` data set read in the loader's workers, when decoding it into
    memory would take more than ``data.in_memory_mb`` (float32 pixels); ``None`` when it
    fits (then :func:`image_folder` decodes it up front: faster per epoch). The same split,
    normalisation (from a 1,000-image sample) and class names either way."""
    from glassloop.data.lazy import DiskData, ImageFiles, channel_stats, read_image, stats_sample

    names, listings = image_listing(cfg)
    shape = image_shape(cfg, listings[0][0][0])
    if len(listings) == 2:
        (train, y_tr), (val, y_va) = listings
    else:  # split the indices: the same split as of decoded images
        every, labels = listings[0]
        i_tr, y_tr, i_va, y_va = stratified_split(
            np.arange(len(every)), labels, val_size=cfg.val_fraction, seed=cfg.seed
        )
        train, val = [every[i] for i in i_tr], [every[i] for i in i_va]
    channels, height, width = shape
    if (len(train) + len(val)) * channels * height * width * 4 <= cfg.in_memory_mb * 2**20:
        return None
    if cfg.normalize:
        sample = stats_sample(len(train), cfg.seed)
        mean, std = channel_stats([read_image(train[int(i)], shape) for i in sample])
    else:  # pixels in [0, 1] only
        mean, std = [0.0] * channels, [1.0] * channels
    preprocessing = {"scale": 1 / 255, "mean": mean, "std": std, "image_shape": list(shape)}
    return DiskData(
        ImageFiles(train, y_tr, shape, mean, std),
        ImageFiles(val, y_va, shape, mean, std),
        preprocessing,
        names,
        shape,
    )


def _unit(x: np.ndarray) -> tuple[list[float], list[float]]:
    """Statistics that leave pixels in [0, 1] (like torchvision's ToTensor alone)."""
    return [0.0] * x.shape[1], [1.0] * x.shape[1]


def _normalised(
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_va: np.ndarray,
    y_va: np.ndarray,
    names: list[str],
    stats: tuple[list[float], list[float]] | None = None,
) -> Splits:
    """Pixels to [0, 1], then per-channel standardisation (given, or from the train split)."""
    train = x_tr.astype(np.float32) / 255.0
    val = x_va.astype(np.float32) / 255.0
    if stats is None:
        mean = train.mean(axis=(0, 2, 3))
        std = train.std(axis=(0, 2, 3))
        std[std == 0] = 1.0
        stats = (mean.tolist(), std.tolist())
    m = np.array(stats[0], dtype=np.float32)[None, :, None, None]
    s = np.array(stats[1], dtype=np.float32)[None, :, None, None]
    preprocessing = {
        "scale": 1 / 255,
        "mean": list(stats[0]),
        "std": list(stats[1]),
        "image_shape": list(x_tr.shape[1:]),
    }
    return from_arrays((train - m) / s, y_tr, (val - m) / s, y_va, names, preprocessing)


IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
CIFAR_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
CIFAR_CLASSES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


# How far gzip can shrink bytes at most (~1032:1): an IDX file's dimensions that claim more
# than this times its .gz's size are refused before anything is decompressed.
GZIP_MAX_RATIO = 1100


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): magic, dimensions, then unsigned bytes. The dimensions
    are read first and what they claim is checked against the file before the data is read
    (a crafted header, a gzip bomb: never more than the file can hold)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        magic = handle.read(4)
        if len(magic) < 4 or magic[:3] != b"\x00\x00\x08":
            raise DataError(f"data: '{path}' is not an unsigned-byte IDX file")
        head = handle.read(4 * magic[3])
        dims = [int.from_bytes(head[4 * i : 4 * i + 4], "big") for i in range(len(head) // 4)]
        claimed = int(np.prod(dims, dtype=object)) if dims else 0
        stored = path.stat().st_size * (GZIP_MAX_RATIO if path.suffix == ".gz" else 1)
        if len(dims) != magic[3] or claimed > stored:
            raise DataError(
                f"data: '{path}' claims {dims} bytes of images or labels, more than the file "
                "holds: truncated or crafted"
            )
        data = handle.read(claimed + 1)  # (one more: bytes left over are a wrong file too)
    if len(data) != claimed:
        raise DataError(f"data: '{path}' is truncated or too long ({len(data)} of {claimed} bytes)")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _find(root: Path, candidates: list[Path], name: str) -> Path | None:
    for folder in candidates:
        for suffix in ("", ".gz"):
            if (folder / (name + suffix)).is_file():
                return folder / (name + suffix)
    return None


def vision_dataset(cfg: DataConfig) -> Splits:
    root = Path(cfg.root)
    if cfg.name == "cifar10":
        return _cifar10(root, cfg.normalize)
    folder = FOLDERS[cfg.name]
    candidates = [root / folder / "raw", root / folder, root]
    if cfg.download and _find(root, candidates, IDX_FILES["train"][0]) is None:
        _download(cfg.name, root)
    arrays = {}
    for split, (images, labels) in IDX_FILES.items():
        found = [_find(root, candidates, name) for name in (images, labels)]
        if None in found:
            every = ", ".join(n for pair in IDX_FILES.values() for n in pair)
            raise DataError(
                f"data: {cfg.name} files not found: place {every} "
                f"(optionally .gz) in '{root / folder / 'raw'}', or install glassloop[vision] and "
                "set data.download = true"
            )
        x = read_idx(found[0])  # type: ignore[arg-type]
        arrays[split] = (x[:, None, :, :], read_idx(found[1]).astype(np.int64))  # type: ignore[arg-type]
    names = FASHION_CLASSES if cfg.name == "fashion-mnist" else [str(c) for c in range(10)]
    stats = STATS[cfg.name] if cfg.normalize else _unit(arrays["train"][0])
    return _normalised(*arrays["train"], *arrays["val"], names, stats)


def _download(name: str, root: Path) -> None:
    """Fetch MNIST/Fashion-MNIST with torchvision (which writes the raw IDX files we read)."""
    try:
        from torchvision import datasets
    except ImportError:
        raise DataError(
            f"data: downloading {name} needs torchvision: pip install 'glassloop[vision]' (or "
            f"place the files in '{root}' and set data.download = false)"
        ) from None
    cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
    try:
        for train in (True, False):
            cls(root=str(root), train=train, download=True)
    except Exception as err:  # network errors come in many types
        raise DataError(f"data: could not download {name} into '{root}': {err}") from err


def _cifar10(root: Path, normalize: bool = True) -> Splits:
    """CIFAR-10's *binary* version: records of 1 label byte + 3,072 pixel bytes (R, G, B
    planes of 32x32). The python version is pickled, which glassloop never loads."""
    folder = next(
        (f for f in (root / "cifar-10-batches-bin", root) if (f / CIFAR_FILES[0]).is_file()), None
    )
    if folder is None or not all((folder / f).is_file() for f in CIFAR_FILES):
        raise DataError(
            f"data: cifar10 files not found: extract the binary version (cifar-10-binary.tar.gz) "
            f"so that '{root / 'cifar-10-batches-bin'}' holds {', '.join(CIFAR_FILES)} (the "
            "python version is pickled and is not read)"
        )

    def read(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        raw = np.concatenate([np.fromfile(folder / f, dtype=np.uint8) for f in files])
        if raw.size % 3073:
            raise DataError(f"data: cifar10 files in '{folder}' are truncated")
        records = raw.reshape(-1, 3073)
        return records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0].astype(np.int64)

    train, val = read(CIFAR_FILES[:5]), read(CIFAR_FILES[5:])
    stats = STATS["cifar10"] if normalize else _unit(train[0])
    return _normalised(*train, *val, CIFAR_CLASSES, stats)
