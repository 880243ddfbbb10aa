"""Parquet data read lazily from disk: numeric and encoded-image columns train from the
command line through worker processes, predict reads raw inputs the same way, a killed run
resumes bitwise, and a dataset sent to a worker carries a path, not the data."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop, sets
from corpora import reviews
from PIL import Image
from sklearn.datasets import load_digits

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

import glassloop  # noqa: E402
from glassloop.config.assemble import build  # noqa: E402
from glassloop.config.schema import load_config  # noqa: E402


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Arrow copies go to this test's folder, not the user's cache."""
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))


def digits_parquet(path: Path, rows: int | None = None) -> Path:
    """scikit-learn's 8x8 digits (the first ``rows``, else all 1,797) as PNG bytes with
    string labels."""
    digits = load_digits()
    images = []
    for image in digits.images[:rows]:
        buffer = io.BytesIO()
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    names = [f"digit-{d}" for d in digits.target[:rows]]
    pq.write_table(pa.table({"png": images, "label": names}), path)
    return path


def numeric_parquet(path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    label = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "d": x[:, 3],
                             "label": label}), path)  # fmt: skip
    return path


IMAGES = ["data.name=parquet", "data.image_column=png", "model.name=cnn", "data.num_workers=2",
          "train.epochs=3", "train.progress=none", "data.batch_size=64"]  # fmt: skip


def test_images_in_parquet_train_through_workers_and_predict(tmp_path: Path) -> None:
    table = digits_parquet(tmp_path / "digits.parquet")
    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--run-dir", str(run), *sets([f"data.path={table}", *IMAGES, "train.progress=lines"]),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_accuracy"] > 0.8
    assert "data: 1,438 training samples, 359 validation" in done.stdout
    Image.fromarray((load_digits().images[0] * 255 / 16).astype(np.uint8)).save(tmp_path / "0.png")
    predicted = run_glassloop("predict", str(run), str(tmp_path / "0.png"))
    assert predicted.returncode == 0, predicted.stderr
    assert predicted.stdout.startswith(f"{tmp_path / '0.png'}: digit-0 ")  # class names travel


def test_numeric_columns_in_parquet(tmp_path: Path) -> None:
    table = numeric_parquet(tmp_path / "numbers.parquet")
    run = tmp_path / "run"
    done = run_glassloop(
        "train", "--run-dir", str(run),
        *sets([f"data.path={table}", "data.name=parquet", "train.epochs=5", "optim.lr=0.01",
               "model.hidden=[16]", "train.progress=none"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_accuracy"] > 0.8
    evaluated = run_glassloop("eval", str(run))
    assert evaluated.returncode == 0 and "accuracy" in evaluated.stdout


class Kill(BaseException):
    """Stands in for kill -9 (raised from inside the run)."""


class KillAtStep(glassloop.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: glassloop.Trainer, step: int, loss: torch.Tensor) -> None:
        if step == self.step:
            raise Kill


def train(run_dir: Path, table: Path, resume: bool = False, kill_at: int = 0) -> dict[str, Any]:
    cfg = load_config(None, [f"data.path={table}", *IMAGES, "checkpoint.every_n_steps=4"])
    run = build(cfg, run_dir=run_dir)
    if kill_at:
        run.trainer.callbacks.append(KillAtStep(kill_at))
    run.trainer.fit(run.train_loader, run.val_loader, epochs=cfg.train.epochs,
                    resume="auto" if resume else None)  # fmt: skip
    return {k: v.clone() for k, v in run.trainer.model.state_dict().items()}


def test_a_killed_run_over_parquet_resumes_bitwise(tmp_path: Path) -> None:
    table = digits_parquet(tmp_path / "digits.parquet", rows=600)  # 480 to train: 8 steps
    straight = train(tmp_path / "straight", table)
    with pytest.raises(Kill):
        train(tmp_path / "cut", table, kill_at=14)  # epoch 2 of 3, after step 12's checkpoint
    resumed = train(tmp_path / "cut", table, resume=True)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_worker_gets_names_not_the_data(tmp_path: Path) -> None:
    table = digits_parquet(tmp_path / "digits.parquet")
    run = build(load_config(None, [f"data.path={table}", *IMAGES]))
    dataset = run.train_loader.dataset
    dataset[0]  # maps the row group from this process's cache
    assert dataset.shards._tables
    assert len(pickle.dumps(dataset)) < 50_000 < table.stat().st_size  # names, no pixels
    assert dataset.shards.folder.is_relative_to(tmp_path / "cache")
    assert not pickle.loads(pickle.dumps(dataset)).shards._tables


def test_an_image_folder_too_large_for_memory_is_read_in_workers(tmp_path: Path) -> None:
    from glassloop.config.assemble import build_parts
    from glassloop.data.lazy import DiskData

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:600], digits.target[:600], strict=True)):
        folder = tmp_path / "digits" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8)).save(folder / f"{i}.png")
    common = [f"data.path={tmp_path / 'digits'}", "data.name=image-folder", "model.name=cnn"]
    in_memory = build_parts(load_config(None, common))
    assert not isinstance(in_memory.data, DiskData)  # 600 tiny images: decoded up front
    lazy = [*common, "data.in_memory_mb=0", "data.num_workers=2", "train.epochs=4",
            "train.progress=none", "optim.lr=0.003"]  # fmt: skip
    assert isinstance(build_parts(load_config(None, lazy)).data, DiskData)
    with pytest.raises(glassloop.ConfigError, match=r"data\.augment works on the in-memory path"):
        build_parts(load_config(None, [*lazy, "data.augment=['hflip']"]))  # never ignored
    run = tmp_path / "run"
    done = run_glassloop("train", "--run-dir", str(run), *sets(lazy))
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_accuracy"] > 0.7
    predicted = run_glassloop("predict", str(run), str(tmp_path / "digits" / "3" / "3.png"))
    assert predicted.returncode == 0 and ": 3 " in predicted.stdout, predicted.stdout


def texts_parquet(path: Path, n: int = 2000, numbers: bool = False) -> list[str]:
    """Generated reviews (tests/corpora.py) as a Parquet table; their texts."""
    rows = reviews(n)
    columns: dict[str, Any] = {"text": [t for t, _ in rows], "label": [label for _, label in rows]}
    if numbers:
        columns["stars"] = [float(i % 5) for i in range(n)]
    pq.write_table(pa.table(columns), path)
    return list(columns["text"])


TEXTS = ["data.name=parquet", "model.name=text-classifier", "model.embed_dim=32",
         "data.vocab_size=200", "data.num_workers=2", "data.batch_size=32", "optim.lr=3e-3",
         "train.epochs=3", "train.progress=none"]  # fmt: skip


def test_a_text_column_in_parquet_is_tokenized_in_workers(tmp_path: Path) -> None:
    table = tmp_path / "reviews.parquet"
    texts = texts_parquet(table)
    run = tmp_path / "run"
    done = run_glassloop("train", "--run-dir", str(run), *sets([f"data.path={table}", *TEXTS]))
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_accuracy"] > 0.9
    assert run_glassloop("eval", str(run)).returncode == 0
    built = build(load_config(None, [f"data.path={table}", *TEXTS]))
    assert built.splits.class_names == ["neg", "pos"]
    batch = next(iter(built.train_loader))  # dynamic padding, like text-csv
    assert batch["attention_mask"].sum(1).tolist() == batch["lengths"].tolist()
    dataset = built.train_loader.dataset
    ids, label = dataset[0]
    assert ids.dtype == torch.long and label.item() in (0, 1)
    # A worker gets the file's path, the rows and the tokenizer, never the texts.
    assert len(pickle.dumps(dataset)) < sum(map(len, texts)) / 2
    assert not pickle.loads(pickle.dumps(dataset)).shards._tables


def test_a_text_column_next_to_numeric_columns_is_not_guessed(tmp_path: Path) -> None:
    table = tmp_path / "mixed.parquet"
    texts_parquet(table, n=50, numbers=True)
    with pytest.raises(glassloop.DataError, match="has a text column 'text' and numeric columns"):
        build(load_config(None, [f"data.path={table}", *TEXTS]))
    numbers = build(load_config(None, [f"data.path={table}", "data.name=parquet",
                                       "data.text_column=", "train.progress=none"]))  # fmt: skip
    assert numbers.splits.input_shape == (1,)  # the stars column


# ------------------------------------------------------------- malformed files: one line each
def parquet_train(table: Path, *extra: str) -> Any:
    return run_glassloop("train", *sets([
        f"data.path={table}", "data.name=parquet", "train.epochs=1", "model.hidden=[8]",
        "train.progress=none", *extra,
    ]))  # fmt: skip


def assert_refused(done: Any, *parts: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_malformed_parquet_files_are_refused_in_one_line_before_training(tmp_path: Path) -> None:
    """Each of these trained silently, crashed with a traceback, hung, or (a label of
    10**12) built 10**12 class names until the kernel killed the process."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2))
    y = (x[:, 0] > 0).astype(np.int64)
    with_nan, with_null = x[:, 1].copy(), [None if i == 9 else v for i, v in enumerate(x[:, 1])]
    with_nan[17] = np.nan
    texts = [f"good text {i}".encode() for i in range(200)]
    texts[33] = b"\xff\xfe not utf-8"
    cases = {
        "huge.parquet": ({"a": x[:, 0], "label": np.where(np.arange(200) == 5, 10**12, y)},
                         ["column 'label' has a label of 1000000000000 for 200 rows"]),
        "nan.parquet": ({"a": x[:, 0], "b": with_nan, "label": y}, ["column 'b' row 17", "NaN"]),
        "null.parquet": ({"a": x[:, 0], "b": pa.array(with_null), "label": y},
                         ["column 'b' row 9: a missing value"]),
        "empty.parquet": ({"a": pa.array([], pa.float64()), "label": pa.array([], pa.int64())},
                          ["has 0 row(s)"]),
        "utf8.parquet": ({"text": pa.array(texts, pa.binary()).view(pa.string()), "label": y},
                         ["column 'text' row 33: bytes that are not UTF-8"]),
    }  # fmt: skip
    for name, (columns, message) in cases.items():
        pq.write_table(pa.table(columns), tmp_path / name)
        extra = ["model.name=text-classifier", "data.vocab_size=50"] if "utf8" in name else []
        assert_refused(parquet_train(tmp_path / name, *extra), f"'{tmp_path / name}'", *message)


def test_a_damaged_page_is_named_by_its_row_group(tmp_path: Path) -> None:
    """pyarrow checks page checksums only for files written with them (write_page_checksum);
    such a file with a flipped bit is refused naming its row group. (Without checksums a
    flipped bit in a value decodes silently: the docs say so.)"""
    table = tmp_path / "t.parquet"
    x = np.random.default_rng(0).normal(size=(400, 2))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "label": (x[:, 0] > 0).astype(np.int64)}),
                   table, write_page_checksum=True, compression="none")  # fmt: skip
    data = bytearray(table.read_bytes())
    data[200] ^= 0x40  # inside column a's data page
    table.write_bytes(bytes(data))
    assert_refused(parquet_train(table), f"'{table}' row group 0 cannot be decoded")


def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    table = numeric_parquet(tmp_path / "numbers.parquet")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLASSLOOP_CACHE_DIR", str(blocked))
        assert_refused(parquet_train(table), "cannot write the cache", "GLASSLOOP_CACHE_DIR")
