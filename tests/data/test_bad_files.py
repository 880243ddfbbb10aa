"""A bad file read by a DataLoader worker ends the run with one line (exit 2) within seconds,
its workers reaped: it used to print the worker's traceback and never exit (the workers,
which ignore SIGTERM so a preemption can checkpoint first, outlived the error and the process
hung at exit joining them). Files that are not regular files are refused before training."""

from __future__ import annotations

import io
import multiprocessing
import os
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import run_glassloop, sets
from PIL import Image, PngImagePlugin

import glassloop
from glassloop.config.assemble import build
from glassloop.config.schema import load_config

LAZY = ["data.name=image-folder", "data.in_memory_mb=0", "data.num_workers=2",
        "data.batch_size=4", "model.hidden=[8]", "train.progress=none"]  # fmt: skip


def image_folder(root: Path, per_class: tuple[int, int] = (12, 4)) -> Path:
    rng = np.random.default_rng(0)
    for split, count in zip(("train", "val"), per_class, strict=True):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (8, 8, 3)).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb(path: Path) -> None:
    """A valid PNG header that claims 20,000 x 20,000 pixels (400 million) in a few bytes."""
    header = struct.pack(">IIBBBBB", 20_000, 20_000, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * 10)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat)
                     + png_chunk(b"IEND", b""))  # fmt: skip


def huge_text_chunk(path: Path) -> None:
    """A PNG with a compressed text chunk that inflates to 200 MB."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "a" * (200 * 2**20), zip=True)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG", pnginfo=info)
    path.write_bytes(buffer.getvalue())


def flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the image data: its CRC no longer matches
    path.write_bytes(bytes(data))


BAD: dict[str, Callable[[Path], Any]] = {
    "random bytes": lambda p: p.write_bytes(np.random.default_rng(1).bytes(300)),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:40]),
    "zero bytes": lambda p: p.write_bytes(b""),
    "text named .png": lambda p: p.write_text("not an image"),
    "a flipped byte": flipped,
    "decompression bomb": bomb,
    "200 MB text chunk": huge_text_chunk,
}


def no_live_workers() -> bool:
    return not [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize("where", ["train", "val"])
@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_file_read_in_a_worker_is_one_line_and_no_worker_outlives_it(
    tmp_path: Path, bad: str, where: str
) -> None:
    root = image_folder(tmp_path / "imgs")
    run = build(load_config(None, [*LAZY, f"data.path={root}", "train.epochs=1"]))
    BAD[bad](root / where / "dog" / "1.png")  # after the statistics: read in a worker only
    start = time.monotonic()
    with pytest.raises(glassloop.DataError) as caught:
        run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith("data: cannot read image") and "1.png" in message, message
    assert no_live_workers()
    assert time.monotonic() - start < 30


def test_an_image_that_goes_bad_after_epoch_2_stops_the_run_in_one_line(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs")
    run = build(load_config(None, [*LAZY, f"data.path={root}", "train.epochs=3"]))

    class Spoil(glassloop.Callback):
        def on_epoch_end(self, trainer: Any, row: dict[str, Any]) -> None:
            if row["epoch"] == 2:
                (root / "train" / "cat" / "3.png").write_bytes(b"garbage")

    run.trainer.callbacks.append(Spoil())
    with pytest.raises(glassloop.DataError, match=r"^data: cannot read image .*3\.png"):
        run.trainer.fit(run.train_loader, run.val_loader, epochs=3)
    assert run.trainer.state.epoch == 2 and no_live_workers()


@pytest.mark.parametrize("kind", ["a folder", "a link to nothing", "a FIFO"])
def test_names_that_are_not_regular_files_are_refused_before_training(
    tmp_path: Path, kind: str
) -> None:
    root = image_folder(tmp_path / "imgs")
    odd = root / "train" / "cat" / "odd.png"
    if kind == "a folder":
        odd.mkdir()
    elif kind == "a link to nothing":
        odd.symlink_to(tmp_path / "nowhere.png")
    else:
        os.mkfifo(odd)  # a worker opening it would wait for a writer forever
    done = run_glassloop("train", *sets([*LAZY, f"data.path={root}", "train.epochs=1"]))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("move it out of the image folder"), done.stderr
    assert "odd.png' is not a regular file" in done.stderr


def test_the_command_exits_2_within_seconds_with_its_workers_gone(tmp_path: Path) -> None:
    """As a user runs it: a process of its own, which used to hang at exit for good."""
    root = image_folder(tmp_path / "imgs", per_class=(600, 4))  # > the 1,000-image sample
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from glassloop.cli.main import main\n"
        f"sets = {[*LAZY, f'data.path={root}', 'train.epochs=1']!r}\n"
        "Path(sys.argv[1]).write_bytes(b'garbage')\n"
        "sys.exit(main(['train', *[a for s in sets for a in ('--set', s)]]))\n"
    )
    from glassloop.config.schema import DataConfig
    from glassloop.data.files import image_listing
    from glassloop.data.lazy import stats_sample

    train = image_listing(DataConfig(name="image-folder", path=str(root)))[1][0][0]
    sampled = set(stats_sample(len(train), 0).tolist())  # (files read for the statistics)
    unread = next(f for i, f in enumerate(train) if i not in sampled)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, str(unread)], capture_output=True, text=True,
        timeout=120, check=False, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("glassloop: error: data: cannot read")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert time.monotonic() - start < 90
