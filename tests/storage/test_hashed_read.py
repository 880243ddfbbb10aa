"""A checkpoint read in one pass: each file hashed as it is read, the tensors made from the
bytes hashed, and a damaged file still refused by its SHA-256 before anything is loaded."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from glassloop import CheckpointError
from glassloop.checkpoint.checkpointer import Checkpointer
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.state import TrainState
from glassloop.storage.hashed_files import (
    DIRECT_MIN,
    DTYPE_NAMES,
    read_hashed,
    write_digested,
    write_safetensors,
)
from glassloop.storage.weights import read_safetensors_header


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


@pytest.mark.parametrize("copy", [True, False])
def test_the_tensors_are_safetensors_own_and_the_digest_the_files(
    tmp_path: Path, copy: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"{dtype}".removeprefix("torch."): (torch.rand(3, 5, generator=g) * 100).to(dtype)
        for dtype in DTYPE_NAMES
    }
    tensors |= {
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "big": torch.randn(3 << 20),
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(tensors, path, {"format": "test"})
    read, digest = read_hashed(path, read_safetensors_header(path), copy=copy)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    expected = load_file(path)
    assert set(read) == set(expected)
    for name, tensor in read.items():
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape
        assert raw(tensor) == raw(expected[name]), name
        if copy and tensor.numel():  # memory of its own (a reduction sums in the same order)
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def saved(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of a model after two Adam steps, and the weights it holds."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
    checkpointer = Checkpointer(run_dir, CheckpointConfig(), model=model)
    checkpointer.attach({"loop": TrainState(step=2), "optimizer": optimizer})
    path = checkpointer.save()
    assert path is not None
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_read_once_gives_back_what_was_saved(tmp_path: Path) -> None:
    path, weights = saved(tmp_path)
    checkpoint = read_checkpoint(path)
    assert all(torch.equal(checkpoint.model_tensors[k], v) for k, v in weights.items())
    moments = checkpoint.state["optimizer"]["state"][0]
    assert moments["exp_avg"].shape == (32, 64) and moments["exp_avg_sq"].min() >= 0


@pytest.mark.parametrize("where", ["header", "middle", "last"])
@pytest.mark.parametrize(
    "name", ["model.safetensors", "state.safetensors", "state.json", "meta.json"]
)
def test_a_changed_byte_is_named_by_its_sha256_and_nothing_is_loaded(
    tmp_path: Path, name: str, where: str
) -> None:
    """A byte changed anywhere (a safetensors header too, which would otherwise fail its
    own check first) is refused as a file that fails its SHA-256 check, in one line, and the
    model and the optimizer resuming from it are left as they were."""
    path, _ = saved(tmp_path)
    data = bytearray((path / name).read_bytes())
    at = {"header": 12, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    (path / name).write_bytes(bytes(data))
    torch.manual_seed(1)
    model = nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(), model=model)
    checkpointer.attach({"loop": TrainState(), "optimizer": optimizer})
    with pytest.raises(CheckpointError) as info:
        checkpointer.resume(path, epochs=1)
    assert str(info.value).splitlines() == [
        f"checkpoint: '{path}': {name} fails its SHA-256 check (corrupt or modified)"
    ]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert optimizer.state_dict()["state"] == {} and checkpointer.state.step == 0


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_large_file_written_past_the_page_cache_has_every_byte(
    tmp_path: Path, where: str
) -> None:
    """A file of 4 MiB and more goes out through a page-aligned buffer with ``O_DIRECT``
    (its last partial block without; tmpfs refuses ``O_DIRECT``: through the page cache):
    the same bytes and digest either way, pieces of any length and alignment."""
    folder = tmp_path if where == "disk" else Path("/dev/shm")
    if not folder.is_dir():
        pytest.skip("no tmpfs at /dev/shm")
    tensor = torch.randn(3_000_001)
    pieces = [b"head" * 3, memoryview(tensor.numpy()).cast("B")[4:], b"tail" * 5]
    expected = b"".join(bytes(piece) for piece in pieces)
    path = folder / f"direct-{tmp_path.name}"
    try:
        size, digest = write_digested(path, pieces)
        assert path.read_bytes() == expected and size == len(expected) > DIRECT_MIN
        assert digest == hashlib.sha256(expected).hexdigest()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("refusal", ["EINVAL", "short"])
def test_o_direct_refused_mid_file_keeps_every_byte_in_order(
    tmp_path: Path, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that takes ``O_DIRECT`` but refuses the write itself (EINVAL), or writes
    part of a block: the rest goes through the page cache, the bytes already buffered first.
    (They came last once: a 12 MB file was saved with its right digest and wrong bytes, a
    checkpoint lost only when a resume needed it.)"""
    import errno
    import fcntl
    import os

    real = os.write

    def direct_refused(fd: int, data: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if refusal == "EINVAL":
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, memoryview(data)[: len(data) - 512 - 7])  # (a misaligned part)
        return real(fd, data)

    monkeypatch.setattr(os, "write", direct_refused)
    tensor = torch.randn(3_000_000)  # 12 MB: more than one buffer
    path = tmp_path / "m.safetensors"
    size, digest = write_safetensors({"w": tensor}, path, {"k": "v"})
    data = path.read_bytes()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    assert torch.equal(load_file(str(path))["w"], tensor)


def test_a_meta_json_of_another_shape_is_named_by_its_sha256(tmp_path: Path) -> None:
    """meta.json replaced by valid JSON of the same size but not an object: the weights'
    check reads it before the digests are compared, and what it raises (AttributeError) is
    not the line: the file fails its SHA-256 check, and a resume passes over it."""
    path, _ = saved(tmp_path)
    size = len((path / "meta.json").read_bytes())
    (path / "meta.json").write_text("[" + " " * (size - 2) + "]")
    model = nn.Linear(64, 32)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(), model=model)
    checkpointer.attach({"loop": TrainState(), "optimizer": torch.optim.Adam(model.parameters())})
    with pytest.raises(CheckpointError) as info:
        checkpointer.resume(path, epochs=1)
    assert str(info.value).splitlines() == [
        f"checkpoint: '{path}': meta.json fails its SHA-256 check (corrupt or modified)"
    ]
