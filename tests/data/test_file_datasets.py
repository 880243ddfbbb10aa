"""Datasets from files: tabular CSV, image folders, MNIST IDX files, CIFAR-10 binary."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from glassloop import DataError, build, load_config
from glassloop.config.schema import DataConfig
from glassloop.data import load_splits


def write_csv(path: Path, rows: int = 120) -> np.ndarray:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, rows)
    x = rng.normal(size=(rows, 3)) * [1.0, 50.0, 0.01] + [0.0, 1000.0, 5.0] + y[:, None]
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    lines = ["a,b,species,c"] + [f"{r[0]},{r[1]},{n},{r[2]}" for r, n in zip(x, names, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return x


def test_tabular_csv_is_standardised_with_training_statistics_that_are_saved(
    tmp_path: Path,
) -> None:
    write_csv(tmp_path / "iris.csv")
    cfg = load_config(None, [
        "data.name=csv", f"data.path={tmp_path / 'iris.csv'}", "data.label_column=species",
        "model.hidden=[16]", "train.epochs=3", "train.progress=none",
    ])  # fmt: skip
    run = build(cfg, run_dir=tmp_path / "run")
    splits = run.splits
    assert splits.class_names == ["setosa", "versicolor", "virginica"]
    assert splits.preprocessing["feature_columns"] == ["a", "b", "c"]
    assert torch.allclose(splits.x_train.mean(0), torch.zeros(3), atol=1e-5)  # train only
    assert torch.allclose(splits.x_train.std(0, unbiased=False), torch.ones(3), atol=1e-4)
    run.trainer.fit(run.train_loader, run.val_loader, epochs=3)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        saved = json.loads(f.metadata()["glassloop.model"])["preprocessing"]
    assert saved["mean"] == pytest.approx(splits.preprocessing["mean"])
    assert saved["std"][1] > 10  # the raw scale of column b, kept for prediction


def test_tabular_csv_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("x,label\n1.0,0\nseven,1\n")
    with pytest.raises(DataError, match=r"line 3, column 'x': 'seven' is not a number"):
        load_splits(DataConfig(name="csv", path=str(path)))
    with pytest.raises(DataError, match=r"has no column 'target' .*columns: x, label"):
        load_splits(DataConfig(name="csv", path=str(path), label_column="target"))
    with pytest.raises(DataError, match=r"not found \(data.path"):
        load_splits(DataConfig(name="csv", path=str(tmp_path / "nope.csv")))


def write_images(root: Path, per_class: int = 12, size: int = 10, mode: str = "RGB") -> None:
    rng = np.random.default_rng(0)
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            base = 60 + 120 * c
            pixels = np.clip(rng.normal(base, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).convert(mode).save(root / name / f"{i}.png")


def test_image_folder_on_generated_pngs_trains(tmp_path: Path) -> None:
    write_images(tmp_path / "pets")
    cfg = load_config(None, [
        "data.name=image-folder", f"data.path={tmp_path / 'pets'}", "data.image_size=8",
        "data.val_fraction=0.25", "data.batch_size=4", "model.hidden=[16]", "train.epochs=4",
        "train.progress=none",
    ])  # fmt: skip
    run = build(cfg)
    assert run.splits.class_names == ["cat", "dog"]
    assert run.splits.input_shape == (3, 8, 8)
    assert len(run.splits.y_val) == 6  # 25% of each class
    history = run.trainer.fit(run.train_loader, run.val_loader, epochs=4)
    assert history[-1]["val_accuracy"] == 1.0  # dark cats, bright dogs


def test_image_folder_with_train_and_val_folders_grayscale(tmp_path: Path) -> None:
    write_images(tmp_path / "d" / "train", per_class=5, mode="L")
    write_images(tmp_path / "d" / "val", per_class=2, mode="L")
    splits = load_splits(DataConfig(name="image-folder", path=str(tmp_path / "d")))
    assert splits.input_shape == (1, 10, 10)
    assert (len(splits.y_train), len(splits.y_val)) == (10, 4)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_from_idx_files(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 50), ("t10k", 20)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    splits = load_splits(DataConfig(name="mnist", root=str(tmp_path)))
    assert splits.x_train.shape == (50, 1, 28, 28) and splits.x_val.shape == (20, 1, 28, 28)
    assert splits.y_val.tolist() == [i % 10 for i in range(20)]
    assert splits.preprocessing["mean"] == [0.1307]


@pytest.mark.parametrize("compressed", [True, False])
def test_an_idx_header_claiming_more_than_the_file_holds_reads_nothing(
    tmp_path: Path, compressed: bool
) -> None:
    """A header claiming 10**9 x 10**6 pixels (or a .gz that would inflate past what gzip
    can): refused from the dimensions, before the data is read or decompressed."""
    from glassloop.data.files import read_idx

    header = bytes([0, 0, 8, 2]) + (10**9).to_bytes(4, "big") + (10**6).to_bytes(4, "big")
    path = tmp_path / ("x-idx2-ubyte" + (".gz" if compressed else ""))
    if compressed:
        with gzip.open(path, "wb") as f:
            f.write(header + bytes(100))
    else:
        path.write_bytes(header + bytes(100))
    with pytest.raises(
        DataError, match=r"claims \[1000000000, 1000000\] bytes .* more than the file"
    ):
        read_idx(path)
    write_idx(tmp_path / "ok.gz", np.arange(6).reshape(2, 3))
    assert read_idx(tmp_path / "ok.gz").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_cifar10_binary_batches(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records = rng.integers(0, 256, (4, 3073)).astype(np.uint8)
        records[:, 0] = np.arange(4)
        records.tofile(folder / name)
    splits = load_splits(DataConfig(name="cifar10", root=str(tmp_path)))
    assert splits.x_train.shape == (20, 3, 32, 32) and splits.x_val.shape == (4, 3, 32, 32)
    assert splits.class_names[:2] == ["airplane", "automobile"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "mnist",
            "mnist files not found: place train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (optionally .gz) in",
        ),
        ("fashion-mnist", "FashionMNIST/raw'"),
        ("cifar10", "cifar10 files not found: extract the binary version"),
    ],
)
def test_missing_files_say_which_files_go_where(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(DataError) as info:
        load_splits(DataConfig(name=name, root=str(tmp_path)))
    assert message in str(info.value)


def test_download_without_torchvision_says_how_to_install(tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed here")
    with pytest.raises(DataError, match=r"needs torchvision: pip install 'glassloop\[vision\]'"):
        load_splits(DataConfig(name="mnist", root=str(tmp_path), download=True))


def test_the_digits_split_is_cached_the_same_bits_without_importing_sklearn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load splits scikit-learn's digits (each seed and fraction its own split);
    a later process reads the cached split, the same bits, with no scikit-learn import (~2 s
    of its start)."""
    import hashlib
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from glassloop.data.splits import stratified_split

    def digest(s: Any) -> str:
        parts = (s.x_train, s.y_train, s.x_val, s.y_val)
        return hashlib.sha256(b"".join(t.numpy().tobytes() for t in parts)).hexdigest()

    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path))
    first = load_splits(DataConfig(name="digits"))
    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    fresh = stratified_split(images, bunch.target.astype(np.int64), val_size=0.2, seed=0)
    for got, want in zip((first.x_train, first.y_train, first.x_val, first.y_val), fresh,
                         strict=True):  # fmt: skip
        assert np.array_equal(got.numpy(), want)
    other = load_splits(DataConfig(name="digits", seed=1))
    assert digest(other) != digest(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "digits-split-0-0.2.npz", "digits-split-1-0.2.npz",
    ]  # fmt: skip
    probe = (
        "import sys, hashlib\n"
        "from glassloop.config.schema import DataConfig\n"
        "from glassloop.data import load_splits\n"
        "s = load_splits(DataConfig(name='digits'))\n"
        "parts = (s.x_train, s.y_train, s.x_val, s.y_val)\n"
        "print(hashlib.sha256(b''.join(t.numpy().tobytes() for t in parts)).hexdigest(),\n"
        "      'sklearn' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.split() == [digest(first), "False"]
