"""glassloop data shard: each kind of input becomes Parquet shards of N rows in row groups of
M rows with every page checksummed (read back with pyarrow, a flipped byte caught), on disk
and on object storage; what it refuses is one line that leaves everything as it was, and a
conversion that fails half-way takes its shards back."""

from __future__ import annotations

import csv
import io
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import run_glassloop
from PIL import Image

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from glassloop.tools import shard_writer  # noqa: E402


def shards(folder: Path) -> list[Any]:
    """The shards in ``folder`` (nothing else is there), opened to verify every page read."""
    names = sorted(os.listdir(folder))
    assert names == [f"part-{i:05d}.parquet" for i in range(len(names))], names
    return [pq.ParquetFile(folder / name, page_checksum_verification=True) for name in names]


def groups(files: list[Any]) -> list[list[int]]:
    """The rows of each row group of each shard."""
    return [[f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] for f in files]


def rows(files: list[Any]) -> dict[str, list[Any]]:
    return pa.concat_tables([f.read() for f in files]).to_pydict()


def flip_a_data_byte(path: Path) -> None:
    """The last byte of the first column's chunk in the first row group: its last data page."""
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + chunk.total_compressed_size - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_csv_streams_into_shards_of_exact_row_groups_every_page_checksummed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,500 rows read 4 KiB at a time (never the whole file), re-cut into row groups of 300
    in shards of 1,000; the integer column that holds 0.5 near its end is read again as
    floats, and said; every value comes back; a flipped byte in a shard is caught."""
    monkeypatch.setattr(shard_writer, "CSV_BLOCK_BYTES", 4096)
    source = tmp_path / "measurements.csv"
    with source.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["length", "width", "label"])
        for i in range(2500):
            writer.writerow([0.5 if i == 2400 else i, i / 4, f"class-{i % 3}"])
    read: list[int] = []
    csv_tables = shard_writer._csv_tables

    def recorded(path: Path, types: dict[str, Any]) -> Any:
        for table in csv_tables(path, types):
            read.append(table.num_rows)
            yield table

    monkeypatch.setattr(shard_writer, "_csv_tables", recorded)
    out = tmp_path / "shards"
    done = run_glassloop(
        "data",
        "shard",
        str(source),
        str(out),
        "--rows-per-shard",
        "1000",
        "--row-group-rows",
        "300",
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip().splitlines()
    # The first two shards, written before the 0.5, removed; the column read again.
    assert said[2:4] == [
        "data shard: removed the 2 shards written so far",
        "data shard: column 'length' holds '0.5' after rows read as int64: reading it as "
        "double from the start again",
    ]
    assert [line.split(":")[0] for line in said[4:7]] == [
        f"wrote {out / f'part-0000{i}.parquet'}" for i in range(3)
    ]
    assert said[7:] == [
        (
            f"data shard: 2,500 rows in 3 shards ({sum(p.stat().st_size for p in out.iterdir()):,} "
            f"bytes) in {out}"
        )
    ]
    assert max(read) < 300 and sum(read) > 2500  # (blocks of ~200 rows; read twice)
    files = shards(out)
    assert groups(files) == [[300, 300, 300, 100], [300, 300, 300, 100], [300, 200]]
    back = rows(files)
    assert back["length"] == [0.5 if i == 2400 else float(i) for i in range(2500)]
    assert back["width"] == [i / 4 for i in range(2500)]
    assert back["label"] == [f"class-{i % 3}" for i in range(2500)]
    flip_a_data_byte(out / "part-00001.parquet")
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(out / "part-00001.parquet", page_checksum_verification=True).read()


def png(pixels: np.ndarray, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=kind)
    return buffer.getvalue()


def test_images_arrays_and_a_datasets_folder_become_shards(tmp_path: Path) -> None:
    """An image folder (its files' bytes, the folder names, in a seeded order), an .npz of
    features into a memory:// prefix, an .npz of float images (PNG of their pixels), a
    Parquet file, and a datasets folder whose Image column names files (their bytes; a row
    without one refused)."""
    rng = np.random.default_rng(0)
    files = {}
    for label, count in (("cat", 4), ("dog", 3)):
        (tmp_path / "pets" / label).mkdir(parents=True)
        for i in range(count):
            kind = "JPEG" if label == "dog" and i == 0 else "PNG"
            data = png(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8), kind)
            (tmp_path / "pets" / label / f"{i}.{kind.lower()}").write_bytes(data)
            files[data] = label
    (tmp_path / "pets" / "cat" / "notes.txt").write_text("not an image")
    done = run_glassloop("data", "shard", str(tmp_path / "pets"), str(tmp_path / "pets-shards"),
                         "--rows-per-shard", "5", "--row-group-rows", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = shards(tmp_path / "pets-shards")
    assert groups(found) == [[2, 2, 1], [2]]
    back = rows(found)
    assert sorted(zip(back["image"], back["label"], strict=True)) == sorted(files.items())
    assert back["label"] != sorted(back["label"])  # (not class by class)

    x = rng.normal(size=(50, 3)).astype(np.float32)
    np.savez(tmp_path / "features.npz", x=x, y=np.arange(50) % 4)
    url = f"memory://shards-{uuid.uuid4().hex}"
    done = run_glassloop("data", "shard", str(tmp_path / "features.npz"), url,
                         "--rows-per-shard", "20")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"in {url}" in done.stdout
    import fsspec

    memory = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[1] for p in memory.ls(url, detail=False))
    assert names == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    found = [pq.ParquetFile(io.BytesIO(memory.cat(f"{url}/{n}")), page_checksum_verification=True)
             for n in names]  # fmt: skip
    memory.rm(url, recursive=True)
    assert groups(found) == [[20], [20], [10]]
    back = rows(found)
    assert list(back) == ["x0", "x1", "x2", "label"]
    assert np.array_equal(np.array([back["x0"], back["x1"], back["x2"]]).T, x)
    assert back["label"] == list(np.arange(50) % 4)

    images = rng.random((7, 5, 4)).astype(np.float32)  # (N, H, W) in [0, 1]
    np.savez(tmp_path / "images.npz", x=images, y=np.arange(7) % 2)
    done = run_glassloop("data", "shard", str(tmp_path / "images.npz"), str(tmp_path / "images"),
                         "--rows-per-shard", "10")  # fmt: skip
    assert done.returncode == 0, done.stderr
    back = rows(shards(tmp_path / "images"))
    decoded = [np.asarray(Image.open(io.BytesIO(b))) for b in back["image"]]
    assert np.array_equal(np.stack(decoded), np.rint(images * 255).astype(np.uint8))
    one_file = tmp_path / "images" / "part-00000.parquet"  # (a Parquet file, cut again)
    done = run_glassloop("data", "shard", str(one_file), str(tmp_path / "again"),
                         "--rows-per-shard", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = shards(tmp_path / "again")
    assert groups(found) == [[3], [3], [1]] and rows(found) == back

    datasets = pytest.importorskip("datasets")
    paths = sorted(str(p) for p in (tmp_path / "pets" / "cat").glob("*.png"))
    named = datasets.Dataset.from_dict({"picture": paths, "label": [0, 1, 0, 1]})
    named = named.cast_column("picture", datasets.Image())  # (save_to_disk reads the files)
    named = named.cast_column("label", datasets.ClassLabel(names=["a", "b"]))
    named.save_to_disk(str(tmp_path / "hf"))
    done = run_glassloop("data", "shard", str(tmp_path / "hf"), str(tmp_path / "hf-shards"),
                         "--rows-per-shard", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    back = rows(shards(tmp_path / "hf-shards"))
    assert back == {"picture": [Path(p).read_bytes() for p in paths], "label": [0, 1, 0, 1]}
    gap = datasets.Dataset.from_dict({"picture": [*paths, None]})
    gap.cast_column("picture", datasets.Image()).save_to_disk(str(tmp_path / "gap"))
    assert refused(
        str(tmp_path / "gap"), str(tmp_path / "gap-shards"), "--rows-per-shard", "2"
    ) == (
        f"glassloop: error: data shard: '{tmp_path / 'gap'}' column 'picture' has no image in row "
        "4; drop such rows first (dataset.filter(lambda row: row['picture'] is not None))\n"
    )
    assert not (tmp_path / "gap-shards").exists()


def test_shards_on_a_real_s3_server(tmp_path: Path) -> None:
    """Uploaded under the prefix, each whole; a prefix that holds objects, and a bucket that
    does not exist, are refused in one line."""
    from s3_server import local_s3

    np.savez(tmp_path / "features.npz", x=np.ones((30, 2)), y=np.zeros(30, dtype=np.int64))
    with local_s3("bucket"):
        import s3fs

        args = ("--rows-per-shard", "25", "--row-group-rows", "10")
        done = run_glassloop(
            "data", "shard", str(tmp_path / "features.npz"), "s3://bucket/train", *args
        )
        assert done.returncode == 0, done.stderr
        s3 = s3fs.S3FileSystem()
        listed = sorted(s3.ls("bucket/train", detail=False))
        assert listed == ["bucket/train/part-00000.parquet", "bucket/train/part-00001.parquet"]
        with s3.open(listed[0], "rb") as handle:
            assert groups([pq.ParquetFile(handle, page_checksum_verification=True)]) == [
                [10, 10, 5]
            ]
        again = run_glassloop(
            "data", "shard", str(tmp_path / "features.npz"), "s3://bucket/train", *args
        )
        nowhere = run_glassloop(
            "data", "shard", str(tmp_path / "features.npz"), "s3://nobucket/train", *args
        )
        assert sorted(s3.ls("bucket/train", detail=False)) == listed
    assert again.returncode == 2
    assert again.stderr == (
        "glassloop: error: data shard: OUTPUT s3://bucket/train already holds objects; glassloop "
        "never writes among objects that are not its own: give a new prefix\n"
    )
    assert nowhere.returncode == 2
    assert "the bucket of s3://nobucket/train does not exist" in nowhere.stderr


def refused(*args: str) -> str:
    """The one line a refused ``glassloop data shard ARGS`` says (exit code 2)."""
    done = run_glassloop("data", "shard", *args)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("glassloop: error: data shard: ")
    return done.stderr


def test_refusals_are_one_line_and_touch_nothing(tmp_path: Path) -> None:
    source = tmp_path / "rows.csv"
    source.write_text("a,label\n1,0\n2,1\n")
    n = ("--rows-per-shard", "10")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("mine")
    assert "OUTPUT" in refused(str(source), str(taken), *n) and "is not empty" in refused(
        str(source), str(taken), *n
    )
    assert sorted(os.listdir(taken)) == ["mine.txt"] and (taken / "mine.txt").read_text() == "mine"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    assert "is a symbolic link" in refused(str(source), str(tmp_path / "link"), *n)
    assert os.listdir(elsewhere) == [] and (tmp_path / "link").is_symlink()

    (tmp_path / "notes.txt").write_text("words")
    assert "none of what glassloop converts" in refused(
        str(tmp_path / "notes.txt"), str(tmp_path / "o"), *n
    )
    assert "not found" in refused(str(tmp_path / "missing.csv"), str(tmp_path / "o"), *n)
    assert "is a URL" in refused("s3://bucket/rows.csv", str(tmp_path / "o"), *n)
    np.savez(tmp_path / "split.npz", x_train=np.ones((3, 2)), y_train=np.zeros(3))
    assert "convert each" in refused(str(tmp_path / "split.npz"), str(tmp_path / "o"), *n)
    assert "give --row-group-rows 10 or less" in refused(
        str(source), str(tmp_path / "o"), *n, "--row-group-rows", "11"
    )
    assert not (tmp_path / "o").exists()


def test_a_conversion_that_fails_half_way_takes_its_shards_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CSV line with a field missing after three shards were written: exit 2 naming it,
    those shards removed, the empty folder given as OUTPUT left as it was."""
    monkeypatch.setattr(shard_writer, "CSV_BLOCK_BYTES", 4096)
    source = tmp_path / "rows.csv"
    source.write_text("a,b,label\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(2000)) + "7,7\n")
    out = tmp_path / "out"
    out.mkdir()
    done = run_glassloop("data", "shard", str(source), str(out), "--rows-per-shard", "500")
    assert done.returncode == 2
    assert done.stderr == (
        f"glassloop: error: data shard: '{source}' is not a CSV file glassloop can read: CSV "
        "parse error: Row #2002: Expected 3 columns, got 2: 7,7\n"
    )
    assert done.stdout.count("wrote ") >= 3
    assert "data shard: removed the " in done.stdout
    assert out.is_dir() and os.listdir(out) == []
