"""Per-step overhead of Trainer.fit against the same hand-written loop, in one process.

Both loops see identical in-memory batches (a list of tensors, so no DataLoader cost hides
the difference), the same model and optimizer; they alternate short epochs (200 steps; each
glassloop epoch is a whole ``Trainer`` + ``fit``, so its per-fit cost is counted) so that
drift of the machine (turbo, other load) hits both. Prints the median of per-epoch time
ratios, next to the same statistic for the hand loop against itself (the noise floor).

    .venv/bin/python benchmarks/overhead.py [--samples 12800] [--batch-size 64] [--reps 41]
        [--train-accuracy]

``--train-accuracy``: glassloop with ``train_accuracy=True`` against a hand loop that counts
the right labels the same way (an argmax per batch, added up on the device, read once per
epoch): what the option costs beyond the work it does.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from glassloop import Trainer
from glassloop.config.models import mlp
from glassloop.data import make_loader

Batches = list[tuple[torch.Tensor, torch.Tensor]]
COUNT = {"accuracy": False}  # --train-accuracy: both loops count the right labels


def make_batches(num_samples: int, batch_size: int) -> Batches:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (num_samples,), generator=g)
    return list(zip(x.split(batch_size), y.split(batch_size), strict=True))


def hand_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any) -> None:
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    correct = torch.zeros((), dtype=torch.int64)
    for x, y in batches:
        out = model(x)
        loss = loss_fn(out, y)
        if COUNT["accuracy"]:
            correct += (out.argmax(-1) == y).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    int(correct)  # (read once, as glassloop's epoch row does)


def trainer_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any) -> None:
    trainer = Trainer(
        model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none",
        train_accuracy=COUNT["accuracy"],
    )  # fmt: skip
    trainer.fit(batches, epochs=1)


class Indexed:
    """The hand loop's in-memory batches: ``x[idx]``, ``y[idx]`` from a seeded permutation,
    what glassloop's fast loader (``make_loader`` on tensors) does per epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.x), generator=self.generator)
        for idx in order.split(self.batch_size):
            yield self.x[idx], self.y[idx]


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(
    run_a: Callable[[], None], run_b: Callable[[], None], reps: int
) -> tuple[float, float, float]:
    """Median of per-rep time ratios b/a, and the median times of a and b (seconds)."""
    ratios, times_a, times_b = [], [], []
    for rep in range(reps):
        # Alternate the order too, so neither loop always runs "second".
        if rep % 2 == 0:
            t_a, t_b = timed(run_a), timed(run_b)
        else:
            t_b, t_a = timed(run_b), timed(run_a)
        ratios.append(t_b / t_a)
        times_a.append(t_a)
        times_b.append(t_b)
    return statistics.median(ratios), statistics.median(times_a), statistics.median(times_b)


def measure(
    name: str,
    build: Callable[[], nn.Module],
    batches: Any,
    reps: int,
    glassloop_batches: Any = None,
) -> float:
    torch.manual_seed(0)
    model_a = build()
    model_b = copy.deepcopy(model_a)
    model_c = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-3)
    opt_c = torch.optim.SGD(model_c.parameters(), lr=1e-3)
    hand_epoch(model_a, opt_a, batches)  # warm-up: allocator, kernels, caches
    theirs = glassloop_batches if glassloop_batches is not None else batches
    trainer_epoch(model_b, opt_b, theirs)
    hand_epoch(model_c, opt_c, batches)
    steps = len(theirs)
    # A/A: the hand loop against itself shows how much of any ratio is the machine's noise.
    noise, _, _ = alternate(
        lambda: hand_epoch(model_a, opt_a, batches),
        lambda: hand_epoch(model_c, opt_c, batches),
        reps,
    )
    ratio, t_hand, t_trainer = alternate(
        lambda: hand_epoch(model_a, opt_a, batches),
        lambda: trainer_epoch(model_b, opt_b, theirs),
        reps,
    )
    print(
        f"{name:<28} hand {1e6 * t_hand / steps:8.1f} us/step"
        f"  glassloop {1e6 * t_trainer / steps:8.1f} us/step"
        f"  ratio {ratio:.3f}  (hand vs hand {noise:.3f})"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=12_800, help="samples per timed fit (one short epoch)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="batch size")
    parser.add_argument("--reps", type=int, default=41, help="alternating timed fits per loop")
    parser.add_argument(
        "--train-accuracy", action="store_true", help="both loops count the right labels"
    )
    args = parser.parse_args()
    COUNT["accuracy"] = args.train_accuracy
    batches = make_batches(args.samples, args.batch_size)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}"
        + (", both counting train accuracy" if args.train_accuracy else "")
    )
    measure(
        "tutorial MLP 784-512-512-10", lambda: mlp((1, 28, 28), 10, [512, 512]), batches, args.reps
    )
    measure("Linear(784, 10)", lambda: mlp((1, 28, 28), 10, []), batches, args.reps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    fast = make_loader((x, y), batch_size=args.batch_size, shuffle=True, seed=0)
    hand = Indexed(x, y, args.batch_size)
    linear = lambda: mlp((1, 28, 28), 10, [])  # noqa: E731
    measure("Linear, in-memory loaders", linear, hand, args.reps, fast)
    measure("Linear, 75-step fits", linear, batches[:75], args.reps)  # per-fit costs show


if __name__ == "__main__":
    main()
