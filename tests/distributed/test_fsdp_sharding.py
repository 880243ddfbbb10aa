"""FSDP2 in one process: what is sharded, that accumulation defers the gradient reduction,
that a sharded (DCP) checkpoint resumes bit for bit, and that it is verified like any other
checkpoint before anything is loaded. (Two processes: tests/distributed/test_fsdp.py.)"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import glassloop.distributed.fsdp as fsdp
from glassloop import Trainer
from glassloop.distributed.world import World
from glassloop.errors import CheckpointError, ConfigError, NonFiniteError
from glassloop.run_dir.checkpoints import read_checkpoint

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_fsdp_sharding")


@pytest.fixture
def one_rank_group() -> Iterator[World]:
    """A real (gloo) process group of one process, so fully_shard can run in this test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield World(0, 1, 0)
    finally:
        dist.destroy_process_group()


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def test_the_units_are_the_blocks_of_a_module_list_else_the_children() -> None:
    model = Blocks()
    assert fsdp.units(model) == [model.layers[0], model.layers[2]]  # ReLU has no parameters
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert fsdp.units(plain) == [plain[0], plain[2]]


def test_accumulation_defers_the_gradient_reduction_to_the_last_micro_batch(
    one_rank_group: World,
) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [id(p) for p in model.parameters()]
    fsdp.shard_model(model, optimizer, one_rank_group, torch.device("cpu"), "32")
    sharded = list(model.parameters())
    # The optimizer now updates the sharded parameters, in the same order.
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in sharded]
    assert [id(p) for p in sharded] != before
    x = torch.randn(3, 4)
    with fsdp.gradient_sync(model, False):  # a micro-batch that is not the window's last
        model(x).sum().backward()
    assert all(p.grad is None for p in sharded)  # kept unsharded, not reduced yet
    with fsdp.gradient_sync(model, True):
        model(x).sum().backward()
    assert all(p.grad is not None for p in sharded)  # reduced: both micro-batches' sum
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference.load_state_dict(fsdp.full_weights(model))
    (2 * reference(x).sum()).backward()
    for p, q in zip(sharded, reference.parameters(), strict=True):
        assert torch.allclose(fsdp.full(p.grad), q.grad)  # type: ignore[arg-type]


def test_a_non_finite_sharded_gradient_is_named(one_rank_group: World) -> None:
    from glassloop.state import TrainState
    from glassloop.step.guards import NonFinitePolicy

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fsdp.shard_model(model, torch.optim.SGD(model.parameters()), one_rank_group,
                     torch.device("cpu"), "32")  # fmt: skip
    model(torch.full((1, 4), float("inf"))).sum().backward()
    with pytest.raises(NonFiniteError, match=re.escape("first non-finite gradient: '0.weight'")):
        NonFinitePolicy("raise")(model, torch.tensor(1.0), TrainState(), 1)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Blocks(), Blocks()])  # lists of blocks inside a list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = torch.cat([stage(x), stage(x)], dim=1)  # (2 outputs -> the next 4 inputs)
        return x


def test_nested_blocks_shard_inner_first_and_compute_what_the_plain_model_does(
    one_rank_group: World,
) -> None:
    torch.manual_seed(0)
    model = Nested()
    plain = Nested()
    plain.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp.shard_model(model, optimizer, one_rank_group, torch.device("cpu"), "32")
    assert fsdp.is_sharded(model.stages[0].layers[0]) and fsdp.is_sharded(model.stages[0])
    x = torch.randn(3, 4)
    assert torch.allclose(model(x), plain(x))
    model(x).sum().backward()
    optimizer.step()  # updates the sharded parameters the model uses
    assert not torch.equal(fsdp.full_weights(model)["stages.0.embed.weight"],
                           plain.stages[0].embed.weight)  # fmt: skip


def test_an_optimizer_over_other_tensors_is_refused_before_anything_is_sharded(
    one_rank_group: World,
) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError, match="not the model's"):
        fsdp.shard_model(model, optimizer, one_rank_group, torch.device("cpu"), "32")
    assert not fsdp.is_sharded(model)


def test_an_optimizer_that_already_stepped_is_refused(one_rank_group: World) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="has not stepped yet"):
        fsdp.shard_model(model, optimizer, one_rank_group, torch.device("cpu"), "32")


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(5)]  # fmt: skip


def trainer(run_dir: Path | None, **kwargs: object) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"strategy": "fsdp", **kwargs}
    return Trainer(model, optimizer, nn.CrossEntropyLoss(), progress="none", run_dir=run_dir,
                   **options)  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("fsdp") / "run"
    trainer(run).fit(data(), data()[:2], epochs=2)
    return run


def test_a_one_process_fsdp_run_writes_dcp_checkpoints_and_resumes_bitwise(
    sharded_run: Path, tmp_path: Path
) -> None:
    first = sharded_run / "checkpoints" / "step-00000005"
    assert (first / "shards").is_dir() and not (first / "model.safetensors").exists()
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(first, cut / "checkpoints" / "step-00000005")
    shutil.copy(sharded_run / "config.json", cut)
    resumed = trainer(cut)
    resumed.fit(data(), data()[:2], epochs=2, resume="auto")
    whole = trainer(None)
    whole.fit(data(), data()[:2], epochs=2)
    weights = zip(
        whole.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
    )
    for a, b in weights:
        assert torch.equal(a, b)
    # ... and the optimizer state too (Adam's moments), through the shards.
    moments = zip(whole.optimizer.state.values(), resumed.optimizer.state.values(), strict=True)
    for a, b in moments:
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_options_are_refused_with_what_to_do() -> None:
    with pytest.raises(
        ConfigError, match="strategy must be one of auto, ddp, fsdp, dp; got 'fsdpp'"
    ):
        trainer(None, strategy="fsdpp", world=World())  # a typo, also with a given world
    with pytest.raises(ConfigError, match=r"ema_decay is not supported with .*fsdp"):
        trainer(None, ema_decay=0.9)
    with pytest.raises(ConfigError, match="use 'bf16'"):
        trainer(None, precision="fp16")


def tampered(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step"
    shutil.copytree(run / "checkpoints" / "step-00000010", copy)
    return copy


def test_a_modified_or_added_shard_is_refused_before_anything_is_loaded(
    sharded_run: Path, tmp_path: Path
) -> None:
    checkpoint = tampered(sharded_run, tmp_path)
    assert read_checkpoint(checkpoint).sharded
    shard = next((checkpoint / "shards").iterdir())
    data_ = bytearray(shard.read_bytes())
    data_[-1] ^= 1
    shard.write_bytes(bytes(data_))
    with pytest.raises(CheckpointError, match="fails its SHA-256 check"):
        read_checkpoint(checkpoint)
    checkpoint = tampered(sharded_run, tmp_path / "b")
    shutil.copy(shard, checkpoint / "shards" / "shard-00009-model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError, match=r"shard-00009.* is not in the manifest"):
        read_checkpoint(checkpoint)
    checkpoint = tampered(sharded_run, tmp_path / "c")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=re.escape("the manifest names '../../etc/passwd'")):
        read_checkpoint(checkpoint)


def test_a_sharded_checkpoint_does_not_resume_a_plain_run(
    sharded_run: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 3))
    plain = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                    progress="none", run_dir=tmp_path / "plain")  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape("resume it with train.strategy = 'fsdp'")):
        plain.fit(data(), epochs=3, resume=sharded_run / "checkpoints" / "step-00000010")
