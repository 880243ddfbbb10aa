"""Every data source, every kind of malformed file (empty, truncated, NaN or missing values,
wrong types, huge labels, corrupt bytes): ``glassloop train`` refuses it with one line and
exit code 2 before training, never a traceback, a hang or a silent wrong run."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_glassloop, sets
from PIL import Image

QUICK = ["train.epochs=1", "train.progress=none", "model.hidden=[4]", "data.batch_size=8"]
rng = np.random.default_rng(0)


def csv_file(rows: list[str]) -> Callable[[Path], list[str]]:
    def write(folder: Path) -> list[str]:
        (folder / "d.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
        return ["data.name=csv", f"data.path={folder / 'd.csv'}"]

    return write


GOOD_ROWS = [f"{i % 7}.5,{i % 3},{i % 2}" for i in range(40)]


def npz_file(**arrays: np.ndarray) -> Callable[[Path], list[str]]:
    def write(folder: Path) -> list[str]:
        np.savez(folder / "d.npz", **arrays)
        return ["data.name=npz", f"data.path={folder / 'd.npz'}"]

    return write


def raw_file(name: str, data: bytes, data_name: str) -> Callable[[Path], list[str]]:
    def write(folder: Path) -> list[str]:
        (folder / name).write_bytes(data)
        return [f"data.name={data_name}", f"data.path={folder / name}"]

    return write


def truncated_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=rng.normal(size=(40, 3)), y=np.arange(40) % 2)
    return buffer.getvalue()[:300]


def claiming(shape: tuple[int, ...]) -> bytes:
    """A .npy whose header claims ``shape`` float32 values and whose data is 64 bytes."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (117 - len(header)) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(64)


def claiming_npz() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("x.npy", claiming((10**12, 10**6)))
        archive.writestr("y.npy", claiming((40,)))
    return buffer.getvalue()


def images(defect: str) -> Callable[[Path], list[str]]:
    def write(folder: Path) -> list[str]:
        root = folder / "imgs"
        for name in ("cat", "dog"):
            (root / name).mkdir(parents=True)
            for i in range(6):
                Image.fromarray(rng.integers(0, 255, (6, 6, 3)).astype(np.uint8)).save(
                    root / name / f"{i}.png"
                )
        bad = root / "dog" / "3.png"
        if defect == "zero bytes":
            bad.write_bytes(b"")
        elif defect == "truncated":
            bad.write_bytes(bad.read_bytes()[:30])
        elif defect == "random bytes":
            bad.write_bytes(rng.bytes(200))
        elif defect == "no images":
            for file in root.rglob("*.png"):
                file.unlink()
        return ["data.name=image-folder", f"data.path={root}"]

    return write


x40 = rng.normal(size=(40, 3))
nan_x = x40.copy()
nan_x[27, 1] = np.nan
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    # CSV
    "csv empty": (csv_file([]), "has no data rows"),
    "csv header only": (csv_file(["a,b,label"]), "has no data rows"),
    "csv short row": (csv_file(["a,b,label", *GOOD_ROWS[:5], "1.0,2", *GOOD_ROWS[5:]]),
                      "line 7 has 2 fields, the header 3"),
    "csv NaN feature": (csv_file(["a,b,label", *GOOD_ROWS, "nan,1,0"]), "NaN or infinite"),
    "csv text feature": (csv_file(["a,b,label", *GOOD_ROWS, "x,1,0"]), "'x' is not a number"),
    "csv huge label": (csv_file(["a,b,label", *GOOD_ROWS, f"1,1,{10**12}"]),
                       "has a label of 1000000000000"),
    "csv real labels": (csv_file(["a,b,label", *[f"{i},1,{i / 3}" for i in range(40)]]),
                        "holds real numbers"),
    "csv not utf-8": (raw_file("d.csv", "a,b,label\n1,2,é\n".encode("latin-1") * 20, "csv"),
                      "not UTF-8"),
    # npz / npy
    "npz empty": (npz_file(x=np.zeros((0, 3)), y=np.zeros(0, dtype=np.int64)), "empty"),
    "npz truncated": (raw_file("d.npz", truncated_npz(), "npz"), "is not a readable .npz file"),
    "npz NaN inputs": (npz_file(x=nan_x, y=np.arange(40) % 2), "NaN or infinite"),
    "npz huge label": (npz_file(x=x40, y=np.where(np.arange(40) == 3, 10**12, 0)),
                       "has a label of 1000000000000"),
    "npz float labels": (npz_file(x=x40, y=np.arange(40) / 3), "labels must be integers"),
    "npz lengths differ": (npz_file(x=x40, y=np.arange(39) % 2), "inputs but"),
    "npz of objects": (npz_file(x=np.array([{"a": 1}] * 40, dtype=object), y=np.arange(40) % 2),
                       "array 'x' holds object values, not numbers"),
    "npz of strings": (npz_file(x=np.array([["a", "b"]] * 40), y=np.arange(40) % 2),
                       "array 'x' holds <U1 values, not numbers; glassloop reads integers"),
    "npz of complex": (npz_file(x=x40 + 1j, y=np.arange(40) % 2),
                       "array 'x' holds complex numbers; glassloop reads integers, floats or "
                       "booleans: convert it first (x.real, if its real part is what you mean)"),
    "npz 0-d": (npz_file(x=np.array(3.0), y=np.arange(40) % 2),
                "array 'x' holds a single value (a 0-d array), not rows of samples"),
    "npz claims 3.47 EiB": (raw_file("d.npz", claiming_npz(), "npz"),
                            "array 'x' claims (1000000000000, 1000000) float32 values "
                            "(4,000,000,000,000,000,000 bytes), more than the file holds"),
    "npz missing arrays": (npz_file(a=x40), "must hold arrays x and y"),
    "npz not a zip": (raw_file("d.npz", b"PK\x03\x04 not really a zip" * 10, "npz"),
                      "is not a readable .npz file"),
    # image folders
    "images zero bytes": (images("zero bytes"), "cannot read image"),
    "images truncated": (images("truncated"), "cannot read image"),
    "images random bytes": (images("random bytes"), "cannot read image"),
    "images none": (images("no images"), "no images"),
    # texts
    "text-csv empty": (raw_file("t.csv", b"", "text-csv"), "t.csv"),
    "text-csv not utf-8": (raw_file("t.csv", "text,label\nété,a\n".encode("latin-1") * 20,
                                    "text-csv"), "not UTF-8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_file_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    write, message = CASES[case]
    settings = write(tmp_path)
    done = run_glassloop("train", *sets([*QUICK, *settings]), "--run-dir", str(tmp_path / "run"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, f"{case}: exit {done.returncode}: {done.stderr[-1500:]}"
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-1500:]
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training


def test_predict_on_a_malformed_array_file_is_one_line(tmp_path: Path) -> None:
    done = run_glassloop("train", *sets([*QUICK, "data.name=synthetic", "data.num_samples=64",
                                         "data.num_features=3"]),
                         "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    crafted = (("huge.npy", claiming((10**12, 3))), ("t.npy", b"\x93NUMPY\x01\x00" + b"{" * 20))
    for name, data in (*crafted, ("z.npz", b"")):
        (tmp_path / name).write_bytes(data)
        predicted = run_glassloop("predict", str(tmp_path / "run"), str(tmp_path / name))
        assert predicted.returncode == 2 and "Traceback" not in predicted.stderr, predicted.stderr
        assert len(predicted.stderr.strip().splitlines()) == 1, predicted.stderr
