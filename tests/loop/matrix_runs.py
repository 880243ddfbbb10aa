"""The runs of tests/loop/test_every_number.py: one task's data, model and loss, and a
script that trains them with glassloop in a process of its own (under torchrun for two
processes, on one node or two), checkpointing every step, optionally killing itself with
SIGKILL at a step, and writing every number glassloop reports into ``RUN_DIR/numbers.json``.

    python matrix_runs.py TASK LOADER RUN_DIR [--kill-at STEP] [--resume] [--async-save]
    python matrix_runs.py TASK LOADER RUN_DIR --ray [--kill-at STEP] [--async-save]

With ``--ray`` the script is the driver of a Ray Train job on a local Ray cluster: two
workers train (``RayReport``), the one killed is restarted by Ray (``FailureConfig``), and
the run resumes from Ray's checkpoint (``resume_from_ray``) in the same job.

The test imports the same definitions for its hand-written reference loop, so both sides
train the same model on the same data; the numbers are computed independently.
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
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

TASKS = ("classification", "bce", "multilabel", "regression", "lm", "sum")
LOADERS = ("glassloop", "dataloader", "generator", "shards")
SHARDS = "s3://matrix"  # Parquet shards in a bucket of the test's S3 server (kind "shards")
EPOCHS = 3
BATCH = 16  # the global batch: two processes take 8 each
VOCAB, LENGTH = 12, 6


def data(task: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training and validation tensors (88 and 40 samples: a short last batch)."""
    g = torch.Generator().manual_seed(7)
    n = 128
    if task == "lm":  # counting sequences mod VOCAB; labels padded (-100) in some rows
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        ids = (start + torch.arange(LENGTH)) % VOCAB
        labels = ids.clone()
        labels[::5, 4:] = -100
        x, y = ids, labels
    else:
        x = torch.randn(n, 6, generator=g)
        if task == "classification":
            y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
        elif task == "bce":
            y = (x[:, :1] - x[:, 1:2] > 0).float()
        elif task == "multilabel":
            y = torch.stack([x[:, 0] > 0, x[:, 1] > x[:, 2], x[:, 3] + x[:, 4] > 1], 1).float()
        elif task == "regression":  # far from zero: R2 sums must not lose precision
            y = 1e6 + torch.stack([x[:, 0] * 3 + x[:, 1], x[:, 2] - x[:, 5]], 1)
        else:  # "sum": a reconstruction, summed over the batch
            y = torch.sigmoid(x)
    return x[:88], y[:88], x[88:], y[88:]


class TinyLM(nn.Module):
    """Computes its own loss and shifts the labels inside, as Hugging Face causal LMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return out


def recon_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A VAE-style reconstruction loss: summed over the batch, not averaged."""
    return F.binary_cross_entropy(torch.sigmoid(output), target, reduction="sum")


def model_and_loss(task: str) -> tuple[nn.Module, Any]:
    """The model (seeded: the same initial weights in every process) and its loss."""
    torch.manual_seed(0)
    if task == "lm":
        return TinyLM(), None
    outputs = {"classification": 3, "bce": 1, "multilabel": 3, "regression": 2, "sum": 6}[task]
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, outputs)]
    if task == "bce":
        layers.append(nn.Sigmoid())
    loss = {
        "classification": nn.CrossEntropyLoss(), "bce": nn.BCELoss(),
        "multilabel": nn.BCEWithLogitsLoss(), "regression": nn.MSELoss(), "sum": recon_sum,
    }[task]  # fmt: skip
    return nn.Sequential(*layers), loss


def write_shards(task: str) -> None:
    """The task's data as Parquet shards in :data:`SHARDS`: three training files in row
    groups of 11 rows, one validation file (a classifier's: features f0..f5, a label)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    fs = s3fs.S3FileSystem()
    x, y, vx, vy = data(task)
    parts = [("train/0", x[:33], y[:33]), ("train/1", x[33:66], y[33:66]),
             ("train/2", x[66:], y[66:]), ("val/0", vx, vy)]  # fmt: skip
    for name, features, labels in parts:
        columns = {f"f{j}": features[:, j].numpy() for j in range(features.shape[1])}
        sink = io.BytesIO()
        pq.write_table(pa.table({**columns, "label": labels.numpy()}), sink, row_group_size=11)
        fs.pipe(f"{SHARDS}/{name}.parquet", sink.getvalue())


def loaders(task: str, kind: str, world: Any = None) -> tuple[Any, Any]:
    """The training and validation loaders of ``kind``: glassloop's (sharded across processes),
    Parquet shards in a bucket read by glassloop (sharded too), a shuffling DataLoader drawing
    from the global RNG, or one with its own generator."""
    from glassloop.data import make_loader

    x, y, vx, vy = data(task)
    if kind == "shards":
        from glassloop.data.options import DataConfig
        from glassloop.data.shards import shard_data

        shards = shard_data(DataConfig(name="parquet", path=f"{SHARDS}/train/",
                                       val_path=f"{SHARDS}/val/", shuffle_window=2))  # fmt: skip
        x, vx = shards.train, shards.val  # (datasets: read as the loaders go)
    if kind in ("glassloop", "shards"):
        options = {"world": world} if world is not None else {}
        per_process = BATCH // (world.size if world is not None else 1)
        train_set, val_set = ((x, y), (vx, vy)) if kind == "glassloop" else (x, vx)
        if kind == "shards":
            options["num_workers"] = 0
        train = make_loader(train_set, batch_size=per_process, shuffle=True, seed=3, **options)
        val = make_loader(val_set, batch_size=per_process, shard="strided", **options)
        return train, val
    generator = torch.Generator().manual_seed(5) if kind == "generator" else None
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=generator)
    return train, DataLoader(TensorDataset(vx, vy), batch_size=BATCH)


def accumulation(task: str) -> int:
    return 2 if task == "sum" else 1  # sums must add up across micro-batches too


def main(argv: list[str]) -> None:
    import glassloop
    from glassloop.distributed.ray_train import RayReport, resume_from_ray
    from glassloop.options import CheckpointConfig

    task, kind, run = argv[0], argv[1], Path(argv[2])
    kill_at = int(argv[argv.index("--kill-at") + 1]) if "--kill-at" in argv else 0
    rank = int(os.environ.get("RANK", "0"))
    killed = run.parent / f"{run.name}.killed"  # (a job Ray restarts is killed once)

    class KillAt(glassloop.Callback):
        def on_step_end(self, trainer: Any, step: int, loss: Any) -> None:
            if step == kill_at and rank == 0 and not killed.exists():
                killed.touch()
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9, before this step's checkpoint

    model, loss = model_and_loss(task)
    trainer = glassloop.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss,
        task={"lm": "language-model", "sum": "custom"}.get(task, "auto"),
        loss_reduction="sum" if task == "sum" else "auto",
        # (a language model's loss is a mean over its tokens: processes weigh theirs so)
        loss_weighting="tokens" if task == "lm" else "samples",
        train_accuracy=task == "classification",  # (counted as it trains)
        grad_accum_steps=accumulation(task), device="cpu", progress="none", log_every=1,
        run_dir=run, checkpoint=CheckpointConfig(
            every_n_steps=1, keep_last=2, async_save="--async-save" in argv
        ),
        callbacks=[KillAt(), *([RayReport()] if "--ray" in argv else [])],
    )  # fmt: skip
    train, val = loaders(task, kind, trainer.world)
    if "--ray" in argv:  # (after a restart: from Ray's newest checkpoint)
        with resume_from_ray(default=None) as resume:
            trainer.fit(train, val, epochs=EPOCHS, resume=resume)
    else:
        trainer.fit(train, val, epochs=EPOCHS, resume="auto" if "--resume" in argv else None)
    result = trainer.evaluate(val)
    predicted = trainer.predict(data(task)[2])
    if trainer.world.is_main:
        numbers = {
            "history": trainer.history,
            "evaluate": {k: v for k, v in result.items() if isinstance(v, float)},
            "predict": predicted.tolist(),
        }
        (run / "numbers.json").write_text(json.dumps(numbers))


def ray_worker(config: dict[str, Any]) -> None:
    main(config["argv"])


def ray_driver(argv: list[str]) -> None:
    """Two Ray Train workers run :func:`main`; a worker killed is restarted once."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Ray's controller takes a report every 2 s by default (a worker's next report waits for
    # it): these runs checkpoint, and so report, every step.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.05"
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20)
    run = Path(argv[2])
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"argv": argv},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(run.parent / f"{run.name}.ray"),
            name="matrix",
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    result = trainer.fit()
    ray.shutdown()
    if result.error is not None:
        raise result.error


if __name__ == "__main__":
    (ray_driver if "--ray" in sys.argv else main)(sys.argv[1:])
