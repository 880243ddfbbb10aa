"""Predict on raw inputs, per data source: raw rows of the training file (pixels, 0-16 digits,
CSV units, image files, texts) through ``Predictor`` / ``glassloop predict`` give what the
trained model computes on the same rows as the data source prepared them for evaluation.
Every transformation a data source applies must travel with the weights."""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop
from PIL import Image
from sklearn.datasets import load_digits

import glassloop
from glassloop.config.assemble import build
from glassloop.config.schema import load_config
from glassloop.data.splits import stratified_split
from glassloop.data.text import pad_collate

QUICK = ["train.epochs=1", "train.progress=none", "model.hidden=[16]", "data.batch_size=32"]


def trained(tmp_path: Path, settings: list[str]) -> tuple[Any, glassloop.Predictor]:
    """A run trained one epoch from ``settings``, and a Predictor read from its run dir."""
    run = build(load_config(None, [*QUICK, *settings]), run_dir=tmp_path / "run")
    run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    return run, glassloop.Predictor.from_path(tmp_path / "run")


def model_inputs(run: Any) -> torch.Tensor:
    """The validation inputs as the data source prepared them (in memory or read lazily)."""
    if hasattr(run.splits, "x_val"):
        return run.splits.x_val
    dataset = run.val_loader.dataset
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def assert_same_predictions(run: Any, predictor: glassloop.Predictor, raw: Any) -> None:
    expected = run.trainer.predict(model_inputs(run))
    got = predictor.predict(raw)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=2e-5), float((got - expected).abs().max())
    assert not predictor.warnings, predictor.warnings[:2]


def test_mnist_5k_raw_pixels(tmp_path: Path) -> None:
    from glassloop.data.datasets import load_mnist_5k_split

    run, predictor = trained(tmp_path, ["data.name=mnist-5k"])
    assert_same_predictions(run, predictor, load_mnist_5k_split()["x_val"])  # uint8 0-255


def test_digits_raw_values_0_to_16(tmp_path: Path) -> None:
    """The README's `glassloop predict runs/x digits.npy`: raw digits are 0-16 and the data
    source scales them by 1/16 (predict fed them unscaled: 38 of 40 probabilities differed)."""
    run, predictor = trained(tmp_path, ["data.name=digits"])
    bunch = load_digits()
    raw_val = stratified_split(bunch.images, bunch.target, val_size=0.2, seed=0)[2]
    assert_same_predictions(run, predictor, raw_val)
    # The same through the command, from a .npy file.
    np.save(tmp_path / "digits.npy", raw_val[:3])
    done = run_glassloop("predict", str(tmp_path / "run"), str(tmp_path / "digits.npy"))
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    best = run.trainer.predict(run.splits.x_val[:3]).argmax(1).tolist()
    shown = [line.split(": ")[1].split(" ")[0] for line in done.stdout.splitlines()]
    assert shown == [str(c) for c in best]
    # Unscaled inputs (already divided by 16, fed where raw ones belong) are flagged.
    predictor.predict(raw_val[:3] / 16.0 / 16.0)
    assert len(predictor.warnings) == 3 and "average" in predictor.warnings[0]


def test_synthetic_and_npz_arrays(tmp_path: Path) -> None:
    run, predictor = trained(tmp_path / "s", ["data.name=synthetic", "data.num_samples=200"])
    assert_same_predictions(run, predictor, run.splits.x_val.numpy())
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (150, 1, 6, 6)).astype(np.float32)
    y = (x.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    run, predictor = trained(tmp_path / "n", ["data.name=npz", f"data.path={tmp_path / 'd.npz'}"])
    raw_val = stratified_split(x, y, val_size=0.2, seed=0)[2]
    assert_same_predictions(run, predictor, raw_val)
    # An image file for a model trained on arrays: its pixel scale is unknown; refused.
    Image.fromarray(np.zeros((6, 6), dtype=np.uint8)).save(tmp_path / "x.png")
    done = run_glassloop("predict", str(tmp_path / "n" / "run"), str(tmp_path / "x.png"))
    assert done.returncode == 2 and "pass a .npy file" in done.stderr, done.stderr


def test_csv_rows_in_their_units(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 150)
    x = rng.normal(size=(150, 3)) * [1.0, 50.0, 0.01] + [0.0, 1000.0, 5.0] + y[:, None]
    rows = [f"{a},{b},{label},{c}" for (a, b, c), label in zip(x, y, strict=True)]
    (tmp_path / "t.csv").write_text("a,b,label,c\n" + "\n".join(rows) + "\n")
    run, predictor = trained(tmp_path, ["data.name=csv", f"data.path={tmp_path / 't.csv'}"])
    raw_val = stratified_split(x.astype(np.float32), y, val_size=0.2, seed=0)[2]
    assert_same_predictions(run, predictor, raw_val)
    # The validation rows as a CSV file (columns in another order): the same predictions.
    lines = ["c,label,a,b"] + [f"{c!r},0,{a!r},{b!r}" for a, b, c in raw_val.tolist()]
    (tmp_path / "val.csv").write_text("\n".join(lines) + "\n")
    _, probs = predictor.predict_files([tmp_path / "val.csv"])
    assert torch.allclose(probs, run.trainer.predict(run.splits.x_val), atol=2e-5)
    # Without a header (numbers from the first line, in the training columns' order): every
    # row predicted, the first one too, named by its line (issue 37: it was dropped).
    lines = [f"{a!r},{b!r},{c!r}" for a, b, c in raw_val.tolist()[:3]]
    (tmp_path / "bare.csv").write_text("\n".join(lines) + "\n")
    names, bare = predictor.predict_files([tmp_path / "bare.csv"])
    assert names == ["bare.csv:1", "bare.csv:2", "bare.csv:3"]
    assert torch.allclose(bare, probs[:3], atol=2e-5)
    (tmp_path / "one.csv").write_text(lines[0] + "\n")
    assert predictor.predict_files([tmp_path / "one.csv"])[1].shape == (1, 3)


def write_split_images(root: Path, per_class: tuple[int, int] = (10, 4)) -> list[Path]:
    """Colour PNGs in ``train/`` and ``val/`` (a fixed split); the validation files."""
    rng = np.random.default_rng(0)
    val_files = []
    for split, count in zip(("train", "val"), per_class, strict=True):
        for c, name in enumerate(["cat", "dog"]):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(rng.normal(60 + 120 * c, 30, (8, 8, 3)), 0, 255)
                file = root / split / name / f"{i}.png"
                Image.fromarray(pixels.astype(np.uint8)).save(file)
                if split == "val":
                    val_files.append(file)
    return val_files


@pytest.mark.parametrize("in_memory_mb", [4096, 0], ids=["decoded-up-front", "read-lazily"])
def test_image_folder_files(tmp_path: Path, in_memory_mb: int) -> None:
    files = write_split_images(tmp_path / "pets")
    run, predictor = trained(tmp_path, [
        "data.name=image-folder", f"data.path={tmp_path / 'pets'}",
        f"data.in_memory_mb={in_memory_mb}",
    ])  # fmt: skip
    sources, probs = predictor.predict_files(files)
    assert sources == [str(f) for f in files]
    assert torch.allclose(probs, run.trainer.predict(model_inputs(run)), atol=2e-5)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_idx_files_raw_pixels(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = {
        "train": rng.integers(0, 256, (60, 28, 28)),
        "t10k": rng.integers(0, 256, (20, 28, 28)),
    }
    for prefix, x in images.items():
        write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", x)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.arange(len(x)) % 10)
    run, predictor = trained(tmp_path, ["data.name=mnist", f"data.root={tmp_path}"])
    predictor.warnings.clear()
    expected = run.trainer.predict(model_inputs(run))
    assert torch.allclose(predictor.predict(images["t10k"]), expected, atol=2e-5)


pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.usefixtures("own_cache")
def test_parquet_numeric_and_image_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 3)) * [1.0, 100.0, 0.1]
    label = (x[:, 0] > 0).astype(np.int64)
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": label}),
                   tmp_path / "n.parquet")  # fmt: skip
    run, predictor = trained(
        tmp_path / "n", ["data.name=parquet", f"data.path={tmp_path / 'n.parquet'}"]
    )
    indices = run.val_loader.dataset.rows_of(0)  # (one row group)
    assert_same_predictions(run, predictor, x[indices].astype(np.float32))
    # Encoded images: the validation rows' PNG bytes as files.
    digits = load_digits()
    pngs = []
    for image in digits.images[:300]:
        buffer = io.BytesIO()
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    pq.write_table(pa.table({"png": pngs, "label": digits.target[:300].tolist()}),
                   tmp_path / "i.parquet")  # fmt: skip
    run, predictor = trained(tmp_path / "i", [
        "data.name=parquet", f"data.path={tmp_path / 'i.parquet'}", "data.image_column=png",
    ])  # fmt: skip
    files = []
    for n, i in enumerate(run.val_loader.dataset.rows_of(0)):
        files.append(tmp_path / f"{n}.png")
        files[-1].write_bytes(pngs[int(i)])
    _, probs = predictor.predict_files(files)
    assert torch.allclose(probs, run.trainer.predict(model_inputs(run)), atol=2e-5)


@pytest.mark.usefixtures("own_cache")
def test_texts_through_the_tokenizer(tmp_path: Path) -> None:
    from corpora import reviews

    rows = reviews(300)
    pq.write_table(pa.table({"text": [t for t, _ in rows], "label": [lab for _, lab in rows]}),
                   tmp_path / "t.parquet")  # fmt: skip
    run, predictor = trained(tmp_path, [
        "data.name=parquet", f"data.path={tmp_path / 't.parquet'}", "model.name=text-classifier",
        "model.embed_dim=16", "data.vocab_size=200",
    ])  # fmt: skip
    dataset = run.val_loader.dataset
    for n in range(10):
        ids, _ = dataset[n]
        batch = pad_collate([(ids, 0)], pad_value=int(predictor.spec.get("pad_id", 0)))
        batch.pop("labels")
        expected = run.trainer.predict([batch])
        text = rows[int(dataset.rows_of(0)[n])][0]
        assert torch.allclose(
            torch.from_numpy(predictor.predict_texts([text])), expected, atol=2e-5
        ), text
