"""Trust at the edges: no file can run code, one process per run directory, start-up cleaning
that touches only glassloop's own leftovers, checkpoint readers that trust no number, and the
same weights always written as the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runner import cli, sets
from safetensors.torch import load_file, save_file
from torch import nn

from glassloop import CheckpointError, ModelError, load_model, load_weights
from glassloop.checkpoint.resume import check_training_state
from glassloop.cli.main import main
from glassloop.run_dir.checkpoints import find_resumable, read_checkpoint, sha256_of
from glassloop.run_dir.layout import CHECKPOINT_FILES as FILES
from glassloop.tools.export import export_model

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_trust")

SMALL = [
    "data.name=synthetic", "data.num_samples=256", "data.num_features=8", "model.hidden=[16]",
    "train.epochs=2", "train.progress=none", "checkpoint.keep_last=2",
]  # fmt: skip
HOSTILE = {"target": "subprocess:run", "kwargs": {"args": ["sh", "-c", "touch PWNED"]}}


def assert_one_line(err: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("trust") / "run"
    assert main(["train", *sets(SMALL), "--run-dir", str(run)]) == 0
    return run


def rewrite_metadata(path: Path, change: Any) -> None:
    tensors = load_file(str(path))
    metadata = json.loads(json.dumps(read_metadata(path)))
    change(metadata)
    save_file(tensors, str(path), metadata)


def read_metadata(path: Path) -> dict[str, str]:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + length])
    return dict(header.get("__metadata__", {}))


def reseal(checkpoint: Path) -> None:
    """Regenerate a checkpoint's manifest after editing it (what an attacker would do)."""
    files = {
        name: {"size": (checkpoint / name).stat().st_size, "sha256": sha256_of(checkpoint / name)}
        for name in FILES
    }
    manifest = {"creator": "glassloop", "format": 1, "files": files}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def hostile_model(metadata: dict[str, str]) -> None:
    spec = json.loads(metadata["glassloop.model"])
    spec["model"].update(HOSTILE)
    metadata["glassloop.model"] = json.dumps(spec)
    if "glassloop.config.schema" in metadata:
        config = json.loads(metadata["glassloop.config.schema"])
        config["model"].update(HOSTILE)
        metadata["glassloop.config.schema"] = json.dumps(config)


# ------------------------------------------------------------------ 1. files never run code
def test_a_file_that_names_code_to_import_is_refused_everywhere(
    trained: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # where "touch PWNED" would land
    exported = tmp_path / "model.safetensors"
    export_model(trained, exported)
    rewrite_metadata(exported, hostile_model)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    config = json.loads((trained / "config.json").read_text())
    config["model"].update(HOSTILE)
    (run / "config.json").write_text(json.dumps(config))
    latest = (trained / "checkpoints" / "latest").read_text().strip()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in (*FILES, "manifest.json"):
        (checkpoint / name).write_bytes((trained / "checkpoints" / latest / name).read_bytes())
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"]["model"].update(HOSTILE)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    rewrite_metadata(checkpoint / "model.safetensors", hostile_model)
    reseal(checkpoint)
    (run / "model.safetensors").write_bytes(exported.read_bytes())
    inputs = tmp_path / "x.npy"
    import fsspec
    import numpy as np

    np.save(inputs, np.zeros((2, 8), dtype=np.float32))
    # The same run in a bucket (memory://: the store of this process) for verify-resume.
    fsspec.filesystem("memory").put(str(run), "/hostile/run", recursive=True)
    own = str(run / "config.json")
    attempts = [
        ("predict", str(exported), str(inputs)), ("eval", str(exported)),
        ("predict", str(run), str(inputs)), ("eval", str(run)), ("report", str(run)),
        ("eval", str(checkpoint)), ("predict", str(checkpoint), str(inputs)),
        # a run's own config.json, taken by --resume or named: a run copied from anywhere
        ("train", "--run-dir", str(run), "--resume"), ("train", own),
        ("train", "--run-dir", str(run), "--resume", "--nproc", "2"),
        ("verify-resume", own, "--kill-at", "1"), ("doctor", own),
        ("verify-resume", "memory://hostile/run", "--kill-at", "1"),
        ("train", "--run-dir", "memory://hostile/run", "--resume"),
    ]  # fmt: skip
    for args in attempts:
        code, _, err = cli(capsys, *args)
        assert code == 2, (args, err)
        if args[0] == "verify-resume" and args[1].startswith(
            "memory://"
        ):  # (said first: where the run was read to)
            err = err.partition("\n")[2]
        assert_one_line(err, "asks to import 'subprocess:run'")
        assert "--trust-code" in err
    with pytest.raises(ModelError, match="trust_code=True"):
        load_model(exported)
    assert not (tmp_path / "PWNED").exists()
    assert cli(capsys, "export", str(checkpoint), "-o", str(tmp_path / "again.safetensors"))[0] == 0
    assert not (tmp_path / "PWNED").exists()  # export copies metadata, imports nothing


MY_NET = """
from torch import nn

class MyNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x):
        return self.body(x)
"""


def test_a_users_own_class_loads_when_passed_or_trusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mynet.py").write_text(MY_NET)
    target = f"{tmp_path / 'mynet.py'}:MyNet"
    run = tmp_path / "run"
    overrides = [*SMALL, f'model.target="{target}"', "model.kwargs={width = 12}"]
    assert cli(capsys, "train", *sets(overrides), "--run-dir", str(run))[0] == 0
    weights = run / "model.safetensors"
    with pytest.raises(ModelError, match="asks to import"):
        load_model(weights)
    from glassloop.config.models import import_target

    trusted = load_model(weights, trust_code=True)
    given = load_model(weights, model_class=import_target(target))
    for a, b in zip(trusted.state_dict().values(), given.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    code, out, err = cli(capsys, "eval", str(run), "--trust-code")
    assert code == 0 and "accuracy:" in out, err
    # Its own resume reads the run's config.json: trusted when said, as eval's.
    assert cli(capsys, "train", "--run-dir", str(run), "--resume")[0] == 2
    code, out, err = cli(capsys, "train", "--run-dir", str(run), "--resume", "--trust-code")
    assert code == 0 and "already finished" in out + err, out + err


# ------------------------------------------------------------- one process per run directory
def test_a_second_process_on_a_run_dir_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from glassloop.run_dir.lock import RunLock

    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):  # another training process holds it
        code, _, err = cli(capsys, "train", *sets(SMALL), "--run-dir", str(run))
    assert code == 2
    assert_one_line(err, f"is in use by another training process (PID {os.getpid()})")
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_a_lock_left_by_a_killed_process_does_not_block_resume(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(run)], check=True)
    (run / ".lock").write_text("999999\n")  # its holder died: the kernel dropped the flock
    code, out, err = cli(capsys, "train", *sets(SMALL), "--run-dir", str(run), "--resume")
    assert code == 0, err
    assert "already finished" in out


# ----------------------------------------------------------- start-up cleaning, symlinks
def test_cleaning_touches_only_glassloops_own_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    mine = [run / ".tmp-mydata", run / ".old-notes-v2", run / "checkpoints" / ".tmp-mine"]
    for folder in mine:
        folder.mkdir(parents=True)
        (folder / "keep.txt").write_text("mine")
    leftovers = [run / ".latest.tmp-123", run / "checkpoints" / ".latest.tmp-77"]
    for leftover in leftovers:
        leftover.write_text("step-00000001\n")
    trash = run / "checkpoints" / ".trash-step-00000003-99"  # a prune cut short by a kill
    trash.mkdir()
    (trash / ".glassloop").touch()
    (trash / "state.json").write_text("{}")
    code, _, err = cli(capsys, "train", *sets(SMALL), "--run-dir", str(run))
    assert code == 0, err
    for folder in mine:
        assert (folder / "keep.txt").read_text() == "mine"
    assert not any(p.exists() for p in [*leftovers, trash])
    steps = [p.name for p in (run / "checkpoints").glob("step-*")]
    assert sorted(steps) == ["step-00000004", "step-00000008"]  # pruned to keep_last


# ------------------------------------------------------------- readers trust no number
def edit_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def nan_weights(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    next(iter(tensors.values()))[0] = float("nan")
    save_file(tensors, str(path), read_metadata(path))


def numpy_rng(checkpoint: Path) -> None:
    def change(tree: dict[str, Any]) -> None:
        tree["rng"]["numpy"] = {"__tuple__": ["MT19937", [1, 2, 3], 0, 0, 0.0]}

    edit_json(checkpoint / "state.json", change)


def world_size(checkpoint: Path) -> None:
    edit_json(checkpoint / "meta.json", lambda meta: meta.update(world_size="two"))


def infinity(checkpoint: Path) -> None:
    path = checkpoint / "state.json"
    text = path.read_text()
    path.write_text(text.replace('"samples_seen": ', '"samples_seen": Infinity, "x": ', 1))


def deep(checkpoint: Path) -> None:
    (checkpoint / "state.json").write_text("[" * 200_000 + "]" * 200_000)


def edit_header(path: Path, change: Any) -> None:
    """Rewrite a safetensors header (``change`` edits it and returns the data bytes)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    parsed = json.loads(raw[8 : 8 + length])
    data = change(parsed, raw[8 + length :])
    text = json.dumps(parsed).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def first_tensor(parsed: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in parsed.items() if k != "__metadata__")


def overlapping(parsed: dict[str, Any], data: bytes) -> bytes:
    entries = [v for k, v in parsed.items() if k != "__metadata__"]
    last = max(entries, key=lambda e: e["data_offsets"][0])
    size = last["data_offsets"][1] - last["data_offsets"][0]
    last["data_offsets"] = [0, size]  # the same bytes as the first tensor
    return data


def negative_dim(parsed: dict[str, Any], data: bytes) -> bytes:
    first_tensor(parsed)["shape"][0] *= -1
    return data


def float_dim(parsed: dict[str, Any], data: bytes) -> bytes:
    entry = first_tensor(parsed)
    entry["shape"] = [float(d) for d in entry["shape"]]
    return data


def trailing(parsed: dict[str, Any], data: bytes) -> bytes:
    return data + b"\x00" * 64


def non_string_metadata(parsed: dict[str, Any], data: bytes) -> bytes:
    parsed["__metadata__"]["format"] = 7
    return data


DAMAGE = {
    "nan-weights": nan_weights,
    "state-infinity": infinity,
    "state-200k-deep": deep,
    "numpy-rng": numpy_rng,
    "world-size-two": world_size,
    "overlapping-offsets": lambda c: edit_header(c / "model.safetensors", overlapping),
    "trailing-bytes": lambda c: edit_header(c / "model.safetensors", trailing),
    "negative-dim": lambda c: edit_header(c / "model.safetensors", negative_dim),
    "float-dim": lambda c: edit_header(c / "model.safetensors", float_dim),
    "non-string-metadata": lambda c: edit_header(c / "model.safetensors", non_string_metadata),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_crafted_checkpoint_is_one_error_and_resume_falls_back(
    trained: Path, tmp_path: Path, damage: str
) -> None:
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(run)], check=True)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    DAMAGE[damage](newest)
    reseal(newest)  # the manifest matches: only the contents are wrong
    with pytest.raises(CheckpointError, match=str(newest)):
        read_checkpoint(newest, check_training_state)  # (the resuming side's check)
    found, problems = find_resumable(run, check_training_state)
    assert found is not None and found.path != newest and len(problems) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda spec: "{not json", "metadata glassloop.model is not JSON"),
        (
            lambda spec: json.dumps({k: v for k, v in spec.items() if k != "input_shape"}),
            "'input_shape'",
        ),
        (
            lambda spec: json.dumps({**spec, "model": {**spec["model"], "hidden": [10**12]}}),
            "model.hidden[0] must be in [1, 1048576]",
        ),
        (
            lambda spec: json.dumps({**spec, "model": {**spec["model"], "hidden": [4096]}}),
            "does not fit the model",
        ),
        (
            lambda spec: json.dumps({**spec, "num_classes": "ten"}),
            "'ten' is not a positive integer",
        ),
    ],
    ids=["not-json", "lacks-keys", "hidden-1e12", "hidden-unmatched", "classes-not-a-number"],
)
def test_a_crafted_model_description_is_one_error(
    trained: Path, tmp_path: Path, change: Any, message: str
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((trained / "model.safetensors").read_bytes())

    def edit(metadata: dict[str, str]) -> None:
        metadata["glassloop.model"] = change(json.loads(metadata["glassloop.model"]))

    rewrite_metadata(path, edit)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert message in str(err.value)


def test_safetensors_files_without_a_manifest_are_checked_too(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, str(path), {"format": "pt"})
    good = path.read_bytes()
    for change in (overlapping, trailing, negative_dim, float_dim, non_string_metadata):
        path.write_bytes(good)
        edit_header(path, change)
        with pytest.raises(CheckpointError):
            load_weights(model, path)


# ------------------------------------------------------------------ 4. same inputs, same bytes
SAVE = """
import sys, torch
from glassloop.storage.weights import save_weights
torch.manual_seed(0)
metadata = {"format": "glassloop-weights", "glassloop.model": "{}", "b": "2", "a": "1"}
save_weights(torch.nn.Linear(4, 3), sys.argv[1], metadata)
"""


def test_the_same_weights_are_always_the_same_bytes(tmp_path: Path) -> None:
    """safetensors orders metadata by a per-process hash: 4 keys, 24 orders."""
    digests = set()
    for i in range(3):
        out = tmp_path / f"w{i}.safetensors"
        subprocess.run([sys.executable, "-c", SAVE, str(out)], check=True, timeout=120)
        digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
    assert len(digests) == 1


# ------------------------------------------------- EMA runs: the weights that were measured
def test_eval_and_export_of_an_ema_run_use_the_ema_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    overrides = [*SMALL, "train.ema_decay=0.5"]
    code, out, err = cli(capsys, "train", *sets(overrides), "--run-dir", str(run))
    assert code == 0, err
    trained = out.split("final validation accuracy: ")[1].split("%")[0]
    code, out, err = cli(capsys, "eval", str(run))
    assert code == 0 and f"accuracy: {trained}%" in out, (out, err)
    final = load_file(str(run / "model.safetensors"))
    # A kill after the final checkpoint, before model.safetensors: the checkpoint holds the
    # raw weights and the EMA; export (and eval, predict) must take the EMA.
    (run / "model.safetensors").unlink()
    exported = tmp_path / "exported.safetensors"
    assert cli(capsys, "export", str(run), "-o", str(exported))[0] == 0
    again = load_file(str(exported))
    assert again.keys() == final.keys()
    assert all(torch.equal(again[k], final[k]) for k in final)
    code, out, err = cli(capsys, "eval", str(run))
    assert code == 0 and f"accuracy: {trained}%" in out, (out, err)
