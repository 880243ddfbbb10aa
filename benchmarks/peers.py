"""Per-step cost of the same training under glassloop, a hand-written loop, PyTorch Lightning,
Lightning Fabric, PyTorch Ignite, Hugging Face Accelerate and Keras 3 (torch backend), in one
process, fed the way users feed them: a ``DataLoader``.

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 -r benchmarks/requirements.txt
    .venv-bench/bin/pip install -e .
    OMP_NUM_THREADS=1 .venv-bench/bin/python benchmarks/peers.py --threads 1 2 [--rounds 9]

Workload: the tutorial MLP (784-512-512-10) and Linear(784, 10), SGD lr 1e-3, batch 64, on
in-memory batches served by one ``DataLoader(batch_size=None)`` over pre-made batches (the
same iterable for every framework but Keras, which takes the arrays). glassloop runs twice:
on that DataLoader, and on its own loader (``make_loader``, the fast path) against the hand
loop over the same tensors sliced the same way. Fixed start-up costs (a Lightning Trainer's
setup, Keras compile) are excluded by timing a short and a long epoch and dividing the
difference by the difference in steps: the marginal cost of one step. Every round runs every
framework once in a random order (so drift of the machine hits all alike); the first round is
dropped; the ratio reported is the median over rounds of each round's ratio to the hand loop.
Each framework runs with its logging, checkpointing and progress bars off. ``--fixed`` also
times glassloop's per-fit fixed cost (header, environment, first-batch checks) on a 75-step
fit against the hand loop's.
"""

from __future__ import annotations

import argparse
import os
import random
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


_TENSORS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def tensors(batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches as two tensors, made once (outside the timed steps)."""
    if id(batches) not in _TENSORS:
        _TENSORS[id(batches)] = (torch.cat([b[0] for b in batches]),
                                 torch.cat([b[1] for b in batches]))  # fmt: skip
    return _TENSORS[id(batches)]


def hand_tensors(kind: str, batches: list[Any]) -> None:
    """The hand loop over the tensors glassloop's own loader gets, sliced the same way."""
    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    x, y = tensors(batches)
    for start in range(0, len(x), 64):
        loss = loss_fn(model(x[start : start + 64]), y[start : start + 64])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def glassloop_own_loader(kind: str, batches: list[Any]) -> None:
    from glassloop import Trainer
    from glassloop.data import make_loader

    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    own = make_loader(tensors(batches), batch_size=64, shuffle=False)
    Trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none").fit(
        own, epochs=1
    )


def ignite_fit(kind: str, batches: list[Any]) -> None:
    from ignite.engine import create_supervised_trainer

    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = create_supervised_trainer(model, optimizer, nn.CrossEntropyLoss())
    trainer.run(loader(batches), max_epochs=1)


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
    "Ignite": ignite_fit,
    "Accelerate": accelerate_fit,
    "Keras 3 (torch)": keras_fit,
}
# glassloop's own loader, against the hand loop over the same tensors.
OWN_LOADER: dict[str, Callable[[str, list[Any]], None]] = {
    "hand-written, tensors": hand_tensors,
    "glassloop, own loader": glassloop_own_loader,
}


def marginal(fn: Callable[[str, list[Any]], None], kind: str, short: Any, long: Any) -> float:
    """One framework's marginal cost of a step: (long epoch - short epoch) / extra steps."""
    start = time.perf_counter()
    fn(kind, short)
    t_short = time.perf_counter() - start
    start = time.perf_counter()
    fn(kind, long)
    return (time.perf_counter() - start - t_short) / (LONG - SHORT)


def ratios(kind: str, rounds: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """``{name: (median us/step, median per-round ratio to its baseline)}`` for every
    installed framework; each round runs all of them once in a random order, the first
    round is dropped."""
    short, long = data(SHORT), data(LONG)
    tensors(short), tensors(long)  # (made before anything is timed)
    available: dict[str, Callable[[str, list[Any]], None]] = {}
    for name, fn in {**FRAMEWORKS, **OWN_LOADER}.items():
        try:
            fn(kind, short)  # warm-up (imports, kernels)
        except ImportError as err:
            print(f"  {name:<22} not installed ({err.name})")
            continue
        available[name] = fn
    order = random.Random(seed)
    rows: list[dict[str, float]] = []
    for _ in range(rounds):
        names = list(available)
        order.shuffle(names)
        rows.append({name: marginal(available[name], kind, short, long) for name in names})
    rows = rows[1:]  # (the first round warms caches and allocators)
    out = {}
    for name in available:
        base = "hand-written, tensors" if name in OWN_LOADER else "hand-written"
        per_round = [row[name] / row[base] for row in rows]
        out[name] = (statistics.median(row[name] for row in rows), statistics.median(per_round))
    return out


def fixed_cost(rounds: int) -> tuple[float, float]:
    """glassloop's and the hand loop's whole time for a 75-step fit of the tutorial MLP
    (medians): what a fit costs beyond its steps (environment, header, first-batch checks)."""
    batches = data(75)
    times: dict[str, list[float]] = {"hand-written": [], "glassloop": []}
    for _ in range(rounds):
        for name in times:
            start = time.perf_counter()
            FRAMEWORKS[name]("mlp", batches)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["glassloop"]), statistics.median(times["hand-written"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds (the first is dropped)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads")
    parser.add_argument("--fixed", action="store_true", help="also glassloop's per-fit cost")
    args = parser.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\ntorch {torch.__version__}, {threads} thread(s), batch 64, SGD, DataLoader")
        for kind in ("mlp", "linear"):
            print(f"{'tutorial MLP (784-512-512-10)' if kind == 'mlp' else 'Linear(784, 10)'}")
            for name, (cost, ratio) in ratios(kind, args.rounds).items():
                print(f"  {name:<22} {1e6 * cost:8.1f} us/step   ratio {ratio:5.3f}")
    if args.fixed:
        torch.set_num_threads(args.threads[0])
        ours, hand_time = fixed_cost(args.rounds)
        share = (ours - hand_time) / ours
        print(f"\n75-step fit: glassloop {ours * 1e3:.1f} ms, hand loop {hand_time * 1e3:.1f} ms "
              f"({100 * share:.1f}% of the fit beyond the steps)")  # fmt: skip


if __name__ == "__main__":
    main()
