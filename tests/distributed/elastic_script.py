"""One launch of the elastic-resume chain (test_elastic.py): train runs fed by glassloop's
own loader (DDP, and FSDP2), by Parquet shards streamed through glassloop's shard reader
(``data.name = "parquet"``), and by a ``DataLoader`` over a ``DistributedSampler``, each
resumed from its run directory, recording the sample ids every step trains on, and stopped by
a real SIGTERM to rank 0 alone at a chosen moment. Run under torchrun (any number of
processes) or as a plain script (one process):

    python elastic_script.py ROOT LAUNCH KIND=STOP ...

``KIND``: ``glassloop``, ``fsdp``, ``shards`` or ``dataloader``; ``STOP``: ``step:K`` (SIGTERM after
step K), ``validation:N`` (inside the N-th validation) or ``none``. Each sample's id is its
input's first column, which the model does not read.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from glassloop import Callback, CheckpointConfig, Preempted, Trainer
from glassloop.data import make_loader
from glassloop.distributed.world import init_from_env
from glassloop.loop import StepLoss
from glassloop.step.window import Window

GLOBAL_BATCH = 24  # 1, 2 or 3 processes: 24, 12 or 8 each
# What a config says (data.batch_size, per process): 12 x 2 processes at the chain's start
# (the one-process reference: 24); a resume keeps the run's global batch whatever it says.
PER_PROCESS_AT_START = 12
SAMPLES, EPOCHS = 240, 2  # 10 steps per epoch


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return torch.cat([ids, torch.randn(n, 5, generator=g)], 1), torch.randint(
        0, 3, (n,), generator=g
    )


def write_shards(root: Path) -> None:
    """The training samples as Parquet shards of 50 rows in row groups of 10 (columns ``id``,
    ``f0..f4``, ``label``), and the validation samples in their own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, (x, y) in (("train", data(SAMPLES, 1)), ("val", data(60, 2))):
        (root / "shards" / name).mkdir(parents=True)
        columns = {"id": x[:, 0].numpy(), **{f"f{j}": x[:, j + 1].numpy() for j in range(5)}}
        table = pa.table({**columns, "label": y.numpy()})
        for i in range(0, len(y), 50):
            pq.write_table(table.slice(i, 50), root / "shards" / name / f"part-{i:05d}.parquet",
                           row_group_size=10)  # fmt: skip


def shard_rows(root: Path) -> Any:
    """The training shards as glassloop reads ``data.path`` (a window of 2 row groups), the
    id column left as it is (the others standardised): the sample ids stay readable."""
    from glassloop.data.options import DataConfig
    from glassloop.data.shards import shard_data

    os.environ["GLASSLOOP_CACHE_DIR"] = str(root / "cache")
    folder = root.parent / "shards"  # (written once by the test, beside the runs)
    config = DataConfig(name="parquet", path=str(folder / "train"), val_path=str(folder / "val"),
                        shuffle_window=2)  # fmt: skip
    rows = shard_data(config).train
    rows.preprocess["mean"][0], rows.preprocess["std"][0] = 0.0, 1.0
    return rows


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x[:, 1:])  # (column 0: the sample's id)
        return out


class Recording(Trainer):
    """Records the ids of every step's samples in this process."""

    seen: list[dict[str, Any]]

    def train_step(self, window: Window) -> StepLoss:
        ids = [int(i) for (args, _), _ in window for i in args[0][:, 0]]
        self.seen.append({"step": self.state.step + 1, "epoch": self.state.epoch + 1, "ids": ids})
        return super().train_step(window)


class StopAt(Callback):
    """SIGTERM to this process (rank 0 only) after step K or inside the N-th validation."""

    def __init__(self, spec: str, rank: int) -> None:
        kind, _, n = spec.partition(":")
        self.kind, self.n, self.mine, self.validations = kind, int(n or 0), rank == 0, 0

    def on_step_end(self, trainer: Any, step: int, loss: torch.Tensor) -> None:
        if self.mine and self.kind == "step" and step == self.n:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_start(self, trainer: Any) -> None:
        self.validations += 1
        if self.mine and self.kind == "validation" and self.validations == self.n:
            os.kill(os.getpid(), signal.SIGTERM)


def train(
    root: Path, kind: str, launch: str, stop: str, start_batch: int = PER_PROCESS_AT_START
) -> str:
    """One run (``kind``), resumed when it has checkpoints; what ended it."""
    world = init_from_env(torch.device("cpu"))
    x, y = data(SAMPLES, 1)
    if kind in ("glassloop", "fsdp"):  # built as a config builds it: data.batch_size per process
        loader: Any = make_loader((x, y), batch_size=start_batch, shuffle=True, seed=3,
                                  world=world)  # fmt: skip
    elif kind == "shards":
        loader = make_loader(shard_rows(root), batch_size=start_batch, shuffle=True, seed=3,
                             world=world, num_workers=0)  # fmt: skip
    else:  # the user's own: they pass the global batch's share
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world.size,
                                     rank=world.rank, shuffle=True, seed=3)  # fmt: skip
        loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world.size,
                            sampler=sampler)  # fmt: skip
    val = make_loader(data(60, 2), batch_size=10, world=world, shard="strided")
    torch.manual_seed(0)
    model = Net()
    trainer = Recording(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        nn.CrossEntropyLoss(),
        world=world,
        run_dir=root / kind,
        checkpoint=CheckpointConfig(every_n_steps=5),
        validate_every_n_steps=4,
        strategy="fsdp" if kind == "fsdp" else "auto",
        callbacks=[StopAt(stop, world.rank)],
        progress="none",
    )
    trainer.seen = []
    ended = "finished"
    try:
        trainer.fit(loader, val, epochs=EPOCHS, resume="auto")
    except Preempted as stopped:  # (and what its checkpoint owes: an abandoned validation)
        ended = f"stopped after step {stopped.step}, owed {trainer.state.validation_due!r}"
    finally:
        out = root / f"seen-{kind}-{launch}-{world.rank}.json"
        out.write_text(json.dumps(trainer.seen))
    return ended


if __name__ == "__main__":
    folder, launch_name = Path(sys.argv[1]), sys.argv[2]
    for spec in sys.argv[3:]:
        run_kind, _, stop_at = spec.partition("=")
        print(f"{run_kind}: {train(folder, run_kind, launch_name, stop_at)}", flush=True)
