"""Per-step cost of the same training under glassloop, a hand-written loop, PyTorch Lightning,
Lightning Fabric, Hugging Face Accelerate and Keras 3 (torch backend), in one process.

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 -r benchmarks/requirements.txt
    .venv-bench/bin/pip install -e .
    .venv-bench/bin/python benchmarks/peers.py [--reps 7]

Workload: the tutorial MLP (784-512-512-10) and Linear(784, 10), SGD lr 1e-3, batch 64, on
in-memory batches served by one ``DataLoader(batch_size=None)`` over pre-made batches (the
same iterable for every framework but Keras, which takes the arrays). Fixed start-up costs
(a Lightning Trainer's setup, Keras compile) are excluded by timing a short and a long epoch
and dividing the difference by the difference in steps: the marginal cost of one step. Each
framework runs with its logging, checkpointing and progress bars off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SHORT, LONG = 100, 600


class Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i]


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                             nn.ReLU(), nn.Linear(512, 10))  # fmt: skip
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 64, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (steps * 64,), generator=g)
    return list(zip(x.split(64), y.split(64), strict=True))


def loader(batches: list[Any]) -> DataLoader[Any]:
    return DataLoader(Batches(batches), batch_size=None)


def hand(kind: str, batches: list[Any]) -> None:
    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for x, y in loader(batches):
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def glassloop_fit(kind: str, batches: list[Any]) -> None:
    from glassloop import Trainer

    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    Trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none").fit(
        loader(batches), epochs=1
    )


def lightning_fit(kind: str, batches: list[Any]) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(kind)
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss: torch.Tensor = self.loss_fn(self.model(x), y)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module(), loader(batches))


def fabric_fit(kind: str, batches: list[Any]) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in fabric.setup_dataloaders(loader(batches)):
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def accelerate_fit(kind: str, batches: list[Any]) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer, dl = accelerator.prepare(model, optimizer, loader(batches))
    loss_fn = nn.CrossEntropyLoss()
    for x, y in dl:
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def keras_fit(kind: str, batches: list[Any]) -> None:
    import keras

    layers: list[Any] = [keras.Input((784,))]
    if kind == "mlp":
        layers += [
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
        ]
    layers.append(keras.layers.Dense(10))
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = torch.cat([b[0] for b in batches]).reshape(-1, 784).numpy()
    y = torch.cat([b[1] for b in batches]).numpy()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)


FRAMEWORKS: dict[str, Callable[[str, list[Any]], None]] = {
    "hand-written": hand,
    "glassloop": glassloop_fit,
    "Lightning": lightning_fit,
    "Fabric": fabric_fit,
    "Accelerate": accelerate_fit,
    "Keras 3 (torch)": keras_fit,
}


def marginal_steps(kind: str, reps: int) -> dict[str, float]:
    """Median marginal step cost of every installed framework; the frameworks take turns
    rep by rep, so that drift of the machine hits all of them alike."""
    short, long = data(SHORT), data(LONG)
    available = {}
    for name, fn in FRAMEWORKS.items():
        try:
            fn(kind, short)  # warm-up (imports, kernels)
        except ImportError as err:
            print(f"  {name:<16} not installed ({err.name})")
            continue
        available[name] = fn
    costs: dict[str, list[float]] = {name: [] for name in available}
    for _ in range(reps):
        for name, fn in available.items():
            start = time.perf_counter()
            fn(kind, short)
            t_short = time.perf_counter() - start
            start = time.perf_counter()
            fn(kind, long)
            t_long = time.perf_counter() - start
            costs[name].append((t_long - t_short) / (LONG - SHORT))
    return {name: statistics.median(values) for name, values in costs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="short/long pairs per framework")
    args = parser.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 64, SGD")
    for kind in ("mlp", "linear"):
        print(f"\n{'tutorial MLP' if kind == 'mlp' else 'Linear(784, 10)'}")
        costs = marginal_steps(kind, args.reps)
        base = costs["hand-written"]
        for name, cost in costs.items():
            print(f"  {name:<16} {1e6 * cost:8.1f} us/step   ratio {cost / base:5.2f}")


if __name__ == "__main__":
    main()
