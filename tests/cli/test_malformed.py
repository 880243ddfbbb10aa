"""Every malformed input is one clear line and exit code 2 (3 when a write fails), and
nothing on disk is lost. The command runs in this process (``main``): a subprocess per case
would cost a torch import each."""

from __future__ import annotations

import errno
import json
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import cli, sets

from glassloop import ConfigError, DataError, load_config

SMALL = [
    "data.name=synthetic", "data.num_samples=256", "data.num_features=8", "model.hidden=[16]",
    "train.epochs=1", "train.progress=none",
]  # fmt: skip


def assert_error(result: tuple[int, str, str], code: int, message: str) -> None:
    got, _, err = result
    lines = err.strip().splitlines()
    assert got == code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.seed=100000000000000000000", "train.seed must be an integer that fits in 64 bits"),
        ("train.seed=1e20", "train.seed must be an integer"),
        ("data.num_workers=-1", "data.num_workers must be in [0, 256], got -1"),
        ("data.eval_batch_size=-3", "data.eval_batch_size must be in [0, 2147483648], got -3"),
        ("model.hidden=[-5]", "model.hidden[0] must be in [1, 1048576], got -5"),
        ("model.hidden=[0]", "model.hidden[0] must be in [1, 1048576], got 0"),
        ("model.hidden=[1000000000000]", "model.hidden[0] must be in [1, 1048576]"),
        ("model.hidden=[1e12]", "model.hidden[0] must be an integer"),
        ("data.num_classes=0", "data.num_classes must be in [2, 16777216], got 0"),
        ("scheduler.T_max=0", "scheduler.T_max must be >= 1, got 0"),
        ("train.clip_grad_norm=nan", "train.clip_grad_norm must be a finite number, got nan"),
        ("optim.lr=inf", "optim.lr must be a finite number, got inf"),
        ("optim.weight_decay=nan", "optim.weight_decay must be a finite number, got nan"),
        ("train.ema_decay=1.5", "train.ema_decay must be in [0, 1), got 1.5"),
    ],
)
def test_every_numeric_key_is_checked_where_the_config_is_read(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == f"config: {message}" or message in str(err.value)


def test_a_toml_nested_thousands_deep_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert_error(cli(capsys, "train", str(deep)), 2, "is nested too deeply to be a config")


def test_a_run_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    result = cli(capsys, "train", *sets(SMALL), "--run-dir", str(target))
    assert_error(result, 2, "is a file, not a run directory")
    assert target.read_text() == "mine"


def test_empty_npz_files_for_training_and_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    overrides = [*SMALL, "data.name=npz", f"data.path={empty}"]
    result = cli(capsys, "train", *sets(overrides), "--run-dir", str(tmp_path / "r"))
    assert_error(result, 2, "is not a readable .npz file")
    run = tmp_path / "ok"
    assert cli(capsys, "train", *sets(SMALL), "--run-dir", str(run))[0] == 0
    assert_error(cli(capsys, "predict", str(run), str(empty)), 2, "is not a readable .npz file")
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((2, 8), np.nan, dtype=np.float32))
    assert_error(cli(capsys, "predict", str(run), str(nan)), 2, "holds NaN or inf values")


def png_header_only(path: Path, width: int, height: int) -> None:
    """A tiny PNG file that claims width x height pixels (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def test_a_decompression_bomb_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from glassloop.config.schema import DataConfig
    from glassloop.data.files import image_folder

    folder = tmp_path / "images"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        png_header_only(folder / name / "bomb.png", 100_000, 100_000)
    with pytest.raises(DataError, match=r"cannot read image .*decompression bomb"):
        image_folder(DataConfig(name="image-folder", path=str(folder)))
    mnist = ["train.epochs=1", "train.progress=none", "model.hidden=[8]"]  # 28x28 images
    digits = tmp_path / "digits"
    assert cli(capsys, "train", *sets(mnist), "--run-dir", str(digits))[0] == 0
    result = cli(capsys, "predict", str(digits), str(folder / "a" / "bomb.png"))
    assert_error(result, 2, "decompression bomb")


def chattr(path: Path, flag: str) -> bool:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
    return done.returncode == 0


def test_a_read_only_run_dir_fresh_and_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    constant = [*SMALL, "scheduler.name=none"]  # so that more epochs are no config change
    assert cli(capsys, "train", *sets(constant), "--run-dir", str(run))[0] == 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    if not (chattr(run, "+i") and chattr(fresh, "+i")):  # immutable: refused even to root
        pytest.skip("chattr +i is not available here")
    try:
        before = sorted(p.name for p in run.iterdir())
        longer = sets([*constant, "train.epochs=2"])
        result = cli(capsys, "train", *longer, "--run-dir", str(run), "--resume")
        assert_error(result, 3, f"could not write '{run}/")  # (the file it was writing)
        assert "Operation not permitted (EPERM)" in result[2]
        assert sorted(p.name for p in run.iterdir()) == before
        result = cli(capsys, "train", *sets(SMALL), "--run-dir", str(fresh))
        assert_error(result, 3, f"could not write '{fresh}/")
    finally:
        chattr(run, "-i")
        chattr(fresh, "-i")


def test_a_full_disk_at_the_final_weights_is_exit_3_with_the_real_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import glassloop.tracking.run_log as run_log

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_log, "save_weights", full)
    run = tmp_path / "run"
    result = cli(capsys, "train", *sets(SMALL), "--run-dir", str(run))
    assert_error(result, 3, "No space left on device (ENOSPC)")
    assert (run / "checkpoints" / "latest").is_file()  # the final checkpoint is there


def test_a_failing_run_json_does_not_hide_the_real_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import glassloop.tracking.run_log as run_log

    real = run_log.write_json

    def write_json(path: Path, data: Any) -> None:
        if path.name == "run.json" and data.get("status") == "failed":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(run_log, "write_json", write_json)
    overrides = [*SMALL, "optim.lr=1e30", "train.max_nonfinite_skips=1", "train.nonfinite=skip"]
    code, _, err = cli(capsys, "train", *sets(overrides), "--run-dir", str(tmp_path / "r"))
    assert code == 4, err  # the divergence, not the failure to record it
    assert "non-finite steps in a row" in err.strip().splitlines()[-1]


def test_a_run_dir_deleted_mid_run_is_not_recreated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import glassloop.loop as loop

    run = tmp_path / "run"
    real = loop.Trainer._run_epoch

    def run_epoch(self: Any, *args: Any) -> Any:
        row = real(self, *args)
        shutil.rmtree(run)  # someone deletes the run directory during the first epoch
        return row

    monkeypatch.setattr(loop.Trainer, "_run_epoch", run_epoch)
    result = cli(capsys, "train", *sets(SMALL), "--run-dir", str(run))
    assert_error(result, 3, "disappeared during the run")
    assert not run.exists()


def test_runs_lists_the_others_when_one_run_json_is_malformed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, content in [
        ("a", {"status": "finished", "step": 3, "epoch": 1}),
        ("b", ["not", "an", "object"]),
        ("c", {"status": "finished", "step": "three", "epoch": None}),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(content))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "run.json").write_text("{cut sh")
    code, out, err = cli(capsys, "runs", str(tmp_path))
    assert code == 0, err
    assert "finished" in out and out.count("unreadable run.json") == 2
