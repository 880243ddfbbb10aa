"""Checkpoints: atomic layout, integrity checks, no unpickling, pruning, best, export."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from glassloop import CheckpointError, Trainer, load_model, load_weights
from glassloop.config.schema import CheckpointConfig
from glassloop.data import ResumableLoader
from glassloop.run_dir.checkpoints import find_resumable, list_checkpoints, read_checkpoint
from glassloop.storage.weights import read_safetensors_header


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def trainer(run_dir: Path, **checkpoint: Any) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        run_dir=run_dir,
        checkpoint=CheckpointConfig(**checkpoint),
    )


def train(run_dir: Path, epochs: int = 2, resume: str | None = None, **checkpoint: Any) -> Trainer:
    t = trainer(run_dir, **checkpoint)
    loader = ResumableLoader(data(), batch_size=16, seed=0)
    t.fit(loader, DataLoader(data(48), batch_size=16), epochs=epochs, resume=resume)
    return t


def test_layout_manifest_and_latest(tmp_path: Path) -> None:
    train(tmp_path, every_n_steps=4)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000012\n"
    ckpt = root / "step-00000012"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".glassloop", "manifest.json", "meta.json", "model.safetensors", "state.json", "state.safetensors",
    ]  # fmt: skip
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.safetensors",
        "state.safetensors",
        "state.json",
        "meta.json",
    }
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["step"], meta["epoch"], meta["finished"]) == (12, 2, True)
    assert meta["versions"]["torch"] == torch.__version__
    assert set(read_safetensors_header(ckpt / "model.safetensors")) >= {"0.weight", "2.bias"}
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def corrupt(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bit-flipped":
        flipped = bytearray(raw)
        flipped[len(raw) - 5] ^= 0x01
        path.write_bytes(bytes(flipped))
    elif how == "garbage":
        path.write_bytes(b"\x00garbage" * 50)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run's last checkpoint, shared (each test damages a copy of its own)."""
    run = tmp_path_factory.mktemp("trained")
    train(run)
    return run / "checkpoints" / "step-00000012"


@pytest.mark.parametrize("how", ["truncated", "empty", "bit-flipped", "garbage"])
@pytest.mark.parametrize(
    "name", ["model.safetensors", "state.safetensors", "state.json", "meta.json"]
)
def test_damaged_files_raise_one_checkpoint_error(
    tmp_path: Path, trained: Path, how: str, name: str
) -> None:
    ckpt = tmp_path / "step-00000012"
    shutil.copytree(trained, ckpt)
    corrupt(ckpt / name, how)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(ckpt)
    message = str(info.value)
    assert str(ckpt) in message and name in message


def test_damaged_safetensors_without_manifest_fail_before_allocating(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    path = tmp_path / "w.safetensors"
    path.write_bytes((2**40).to_bytes(8, "little") + b"{}")  # claims a 1 TiB header
    with pytest.raises(CheckpointError, match="header claims 1099511627776 bytes"):
        load_weights(model, path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000000], "data_offsets": [0, 4000000]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\x00" * 16)
    with pytest.raises(CheckpointError, match="points outside the file"):
        read_safetensors_header(path)


def test_resume_falls_back_to_the_previous_valid_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(tmp_path, epochs=1, every_n_steps=3)  # checkpoints at steps 3 and 6 (keep_last 3)
    corrupt(tmp_path / "checkpoints" / "step-00000006" / "model.safetensors", "bit-flipped")
    found, warnings = find_resumable(tmp_path)
    assert found is not None and found.step == 3
    assert "step-00000006" in warnings[0] and "SHA-256" in warnings[0]
    t = train(tmp_path, epochs=1, resume="auto", every_n_steps=3)
    assert "warning: checkpoint:" in capsys.readouterr().out
    assert t.state.step == 6


def test_resume_falls_back_past_weights_that_do_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest checkpoint's weights hold 20,000 keys that are not the model's, its
    manifest consistent (nothing damaged): the resume stopped with a line of megabytes; it
    passes over it for the one before, as over a damaged one, saying so in a short line."""
    train(tmp_path, epochs=1, every_n_steps=3)
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    wrong = save({f"wrong.{i}": torch.zeros(1) for i in range(20_000)})
    (ckpt / "model.safetensors").write_bytes(wrong)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {
        "size": len(wrong),
        "sha256": hashlib.sha256(wrong).hexdigest(),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    t = train(tmp_path, epochs=1, resume="auto", every_n_steps=3)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"warning: checkpoint: '{ckpt}' does not fit the model: missing")
    assert said[0].endswith("and 19,995 more; falling back to an older checkpoint")
    assert len(said[0]) < 600 and "step-00000003' at step 3" in said[1]
    assert t.state.step == 6


def test_an_explicitly_named_bad_checkpoint_fails(tmp_path: Path) -> None:
    train(tmp_path, epochs=1)
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    corrupt(ckpt / "state.json", "truncated")
    with pytest.raises(CheckpointError, match=r"state\.json"):
        train(tmp_path, epochs=2, resume=str(ckpt))


class Payload:
    """Unpickling this creates a marker file: proof that code ran."""

    marker = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("force_unsafe", [False, True])
@pytest.mark.parametrize(
    "name", ["model.safetensors", "state.safetensors", "state.json", "meta.json"]
)
def test_pickle_payload_is_refused_and_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, force_unsafe: bool
) -> None:
    if force_unsafe:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    train(tmp_path, epochs=1)
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    marker = tmp_path / "pwned"
    payload = Payload()
    payload.marker = str(marker)
    torch.save({"x": payload}, ckpt / name)  # a torch.save file is a pickle
    with pytest.raises(CheckpointError):
        train(tmp_path, epochs=2, resume=str(ckpt))
    # Also with a manifest that vouches for the payload: the formats still refuse it.
    manifest = json.loads((ckpt / "manifest.json").read_text())
    from glassloop.run_dir.checkpoints import sha256_of

    manifest["files"][name] = {
        "size": (ckpt / name).stat().st_size,
        "sha256": sha256_of(ckpt / name),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError):
        read_checkpoint(ckpt)
    with pytest.raises(CheckpointError):
        load_weights(nn.Linear(6, 3), ckpt / name) if name.endswith(
            ".safetensors"
        ) else read_checkpoint(ckpt)
    weights = tmp_path / "model.pt"
    with weights.open("wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_weights(nn.Linear(6, 3), weights)
    assert not marker.exists()


def test_loading_into_a_different_model_lists_every_mismatch(tmp_path: Path) -> None:
    train(tmp_path, epochs=1)
    weights = tmp_path / "model.safetensors"
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 4)).double()
    with pytest.raises(CheckpointError) as info:
        load_weights(other, weights)
    message = str(info.value)
    assert "missing keys ['3.bias', '3.weight']" in message
    assert "'2.weight' has shape [3, 8], the model expects [4, 8]" in message
    assert "'0.weight' is F32, the model expects F64" in message


def test_non_finite_weights_are_never_committed(tmp_path: Path) -> None:
    t = train(tmp_path, epochs=1)
    with torch.no_grad():
        t.model[0].weight[0, 0] = float("nan")
    t.state.step = 99
    with pytest.raises(
        CheckpointError, match=r"not finite .*Last good checkpoint: .*step-00000006"
    ):
        t.checkpointer.save()  # (what a step's or an epoch's save runs)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000006"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000006\n"


def test_pruning_keeps_foreign_directories(tmp_path: Path) -> None:
    foreign = tmp_path / "checkpoints" / "step-00000001"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "my-stuff").mkdir()
    train(tmp_path, epochs=3, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000018"]
    assert (foreign / "notes.txt").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "my-stuff").is_dir()


def test_best_checkpoint_follows_the_monitored_metric(tmp_path: Path) -> None:
    t = train(tmp_path, epochs=4, monitor="val_loss", keep_last=1)
    best = read_checkpoint(tmp_path / "best")
    losses = [row["val_loss"] for row in t.history]
    assert best.meta["metrics"]["val_loss"] == min(losses)
    assert best.meta["epoch"] == losses.index(min(losses)) + 1
    assert t.state.best_metric == min(losses)


def test_load_model_rebuilds_from_metadata_only(tmp_path: Path) -> None:
    from glassloop import build, load_config

    cfg = load_config(
        None, ["data.name=synthetic", "model.hidden=[16]", "train.epochs=1", "train.progress=none"]
    )
    run = build(cfg, run_dir=tmp_path)
    run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    model = load_model(tmp_path / "model.safetensors")
    x = run.splits.x_val[:5]
    assert torch.equal(run.trainer.predict(x), torch.softmax(model(x), dim=1).detach())


def test_saved_keys_carry_no_wrapper_prefixes(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    wrapped = nn.DataParallel(model)  # on CPU it just wraps: state_dict keys gain "module."
    assert next(iter(wrapped.state_dict())).startswith("module.")
    from glassloop import save_weights

    save_weights(wrapped, tmp_path / "w.safetensors")
    assert set(read_safetensors_header(tmp_path / "w.safetensors")) - {"__metadata__"} == {
        "0.weight",
        "0.bias",
    }
    load_weights(nn.Sequential(nn.Linear(4, 2)), tmp_path / "w.safetensors")


def test_a_second_signal_aborts_at_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import os, signal, pathlib\n"
        "from glassloop.distributed.preemption import StopSignals\n"
        "with StopSignals() as s:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert s.received == signal.SIGTERM\n"  # the first one only sets a flag
        "    pathlib.Path('first').touch()\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    pathlib.Path('second').touch()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=60, check=False)
    assert result.returncode == 143
    assert (tmp_path / "first").exists() and not (tmp_path / "second").exists()


@pytest.mark.parametrize("metadata", [None, {}, {"z": "1", "a": 'ü"\n'}])
def test_glassloop_writes_the_bytes_safetensors_writes(
    tmp_path: Path, metadata: dict[str, str] | None
) -> None:
    """glassloop writes safetensors files itself (hashing while writing: glassloop.storage.weights);
    for every dtype it knows, odd names, a scalar and an empty tensor, the file is byte for
    byte safetensors' own (metadata sorted), and the size and SHA-256 it returns are the
    file's."""
    from safetensors.torch import save_file

    from glassloop.storage.hashed_files import DTYPE_NAMES, _canonical_header, write_safetensors
    from glassloop.storage.serialization import sha256_of

    tensors: dict[str, torch.Tensor] = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    tensors['é"x\n'] = torch.arange(3)
    for i, dtype in enumerate(DTYPE_NAMES):
        tensors[f"t{i}"] = torch.arange(6).reshape(3, 2).to(dtype)
        tensors[f"b{i}"] = torch.ones(5, dtype=torch.int64).to(dtype)
    tensors["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp_path / "ref"), metadata)
    if metadata and len(metadata) > 1:
        _canonical_header(tmp_path / "ref")
    size, sha = write_safetensors(tensors, tmp_path / "ours", metadata)
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "ref").read_bytes()
    assert (size, sha) == ((tmp_path / "ours").stat().st_size, sha256_of(tmp_path / "ours"))


def test_a_dtype_the_writer_does_not_know_goes_through_safetensors(tmp_path: Path) -> None:
    from glassloop.storage.hashed_files import DTYPE_NAMES, write_safetensors
    from glassloop.storage.serialization import sha256_of
    from glassloop.storage.weights import read_safetensors

    dtype = torch.float8_e4m3fnuz
    assert dtype not in DTYPE_NAMES
    size, sha = write_safetensors({"x": torch.ones(4).to(dtype)}, tmp_path / "f", {"k": "v"})
    assert (size, sha) == ((tmp_path / "f").stat().st_size, sha256_of(tmp_path / "f"))
    tensors, metadata = read_safetensors(tmp_path / "f")
    assert tensors["x"].dtype == dtype and metadata == {"k": "v"}


def test_the_finiteness_check_is_exact_where_a_sum_overflows() -> None:
    """all_finite sums first; a sum that overflows from finite values is checked element by
    element, never refused."""
    from glassloop.storage.weights import all_finite

    big = torch.full((4,), 3e38)
    assert not bool(big.sum().isfinite()) and all_finite(big)
    assert all_finite(torch.full((100_000,), 60_000.0, dtype=torch.float16))
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.ones(1000)
        tensor[500] = bad
        assert not all_finite(tensor)
