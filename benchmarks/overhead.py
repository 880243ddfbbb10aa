"""Per-step overhead of Trainer.fit against the same hand-written loop, in one process.

Both loops are fed the way users feed them: one ``DataLoader(batch_size=None)`` over the same
in-memory batches (``benchmarks/peers.py``'s), the same model and SGD. Each repetition runs
three loops in a rotating order: the hand loop, a second copy of the hand loop (each run's
noise floor: the same code against itself) and glassloop (a whole ``Trainer`` + ``fit`` per
epoch), so drift of the machine (turbo, other load) hits all three. Each runs a short and a
long epoch (100 and 600 steps by default, as peers.py); a step's cost is the long one's extra
time per extra step, so what a fit costs once drops out (the last row, whole 75-step fits,
shows it). Each epoch is timed by the wall clock and by the process's CPU time
(``time.process_time``: what other processes' load does not add). Printed: the median over
repetitions of each repetition's ratio to the hand loop, for both clocks, glassloop's and the
copy's (the noise floor).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py [--samples 38400]
        [--batch-size 64] [--reps 41] [--train-accuracy]

``--train-accuracy``: glassloop with ``train_accuracy=True`` against a hand loop that counts
the right labels the same way (an argmax per batch, added up on the device, read once per
epoch): what the option costs beyond the work it does.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from glassloop import Trainer
from glassloop.config.models import mlp
from glassloop.data import make_loader

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
COUNT = {"accuracy": False}  # --train-accuracy: both loops count the right labels


class Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Pre-made batches, served one by one by a ``DataLoader(batch_size=None)``."""

    def __init__(self, batches: Pairs) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i]


def make_batches(num_samples: int, batch_size: int) -> Pairs:
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


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(
    runs: dict[str, list[Callable[[], None]]], steps: list[int], reps: int
) -> dict[str, list[float]]:
    """Each rep runs every one of ``runs`` once, the order rotated (none always runs first).
    A run is one epoch of ``steps[0]`` steps, timed per step, or a short and a long epoch
    (``steps``: theirs), timed as the long one's extra time per extra step: the marginal
    cost of a step, without what a fit costs once. Per run, its ratio to ``"hand"`` on
    each rep by the wall and the CPU clock, and its wall seconds per step."""
    names = list(runs)
    out: dict[str, list[float]] = {}
    for rep in range(reps):
        per_step: dict[str, tuple[float, float]] = {}
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            (wall, cpu), *longer = [timed(run) for run in runs[name]]
            if longer:  # (long - short) / (its extra steps)
                extra = steps[1] - steps[0]
                wall, cpu = (longer[0][0] - wall) / extra, (longer[0][1] - cpu) / extra
            else:
                wall, cpu = wall / steps[0], cpu / steps[0]
            per_step[name] = wall, cpu
        for name, (wall, cpu) in per_step.items():
            out.setdefault(f"{name} wall", []).append(wall / per_step["hand"][0])
            out.setdefault(f"{name} cpu", []).append(cpu / per_step["hand"][1])
            out.setdefault(f"{name} s", []).append(wall)
    return out


def measure(
    name: str, build: Callable[[], nn.Module], epochs: list[Any], reps: int, own: Any = None
) -> dict[str, float]:
    """``epochs``: one loader (a whole fit, timed) or a short and a long one (marginal);
    ``own``: glassloop's loaders in their place."""
    torch.manual_seed(0)
    model_a = build()
    model_b = copy.deepcopy(model_a)
    model_c = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-3)
    opt_c = torch.optim.SGD(model_c.parameters(), lr=1e-3)
    theirs = own if own is not None else epochs
    runs: dict[str, list[Callable[[], None]]] = {
        "hand": [functools.partial(hand_epoch, model_a, opt_a, data) for data in epochs],
        "hand copy": [functools.partial(hand_epoch, model_c, opt_c, data) for data in epochs],
        "glassloop": [functools.partial(trainer_epoch, model_b, opt_b, data) for data in theirs],
    }
    steps = [len(data) for data in theirs]
    interleaved(runs, steps, 1)  # warm-up: allocator, kernels, caches
    out = {key: statistics.median(values) for key, values in interleaved(runs, steps, reps).items()}
    print(
        f"{name:<30} hand {1e6 * out['hand s']:7.1f} us/step"
        f"  glassloop {1e6 * out['glassloop s']:7.1f}"
        f"  ratio wall {out['glassloop wall']:.3f} cpu {out['glassloop cpu']:.3f}"
        f"  (noise floor, hand copy: wall {out['hand copy wall']:.3f}"
        f" cpu {out['hand copy cpu']:.3f})"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=38_400, help="samples of the long epoch (the short: 1/6)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="batch size")
    parser.add_argument("--reps", type=int, default=41, help="alternating timed fits per loop")
    parser.add_argument(
        "--train-accuracy", action="store_true", help="both loops count the right labels"
    )
    args = parser.parse_args()
    COUNT["accuracy"] = args.train_accuracy
    batches = make_batches(args.samples, args.batch_size)
    short = batches[: len(batches) // 6]  # (peers.py's 100 and 600 steps, by default)
    # how users feed it: one DataLoader over the batches (peers.py's)
    fed = [DataLoader(Batches(part), batch_size=None) for part in (short, batches)]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}"
        + (", both counting train accuracy" if args.train_accuracy else "")
    )
    mlp_784 = lambda: mlp((1, 28, 28), 10, [512, 512])  # noqa: E731
    linear = lambda: mlp((1, 28, 28), 10, [])  # noqa: E731
    measure("tutorial MLP, DataLoader", mlp_784, fed, args.reps)
    measure("Linear(784, 10), DataLoader", linear, fed, args.reps)
    tensors = [
        (torch.cat([b[0] for b in part]), torch.cat([b[1] for b in part]))
        for part in (short, batches)
    ]
    own = [make_loader(xy, batch_size=args.batch_size, shuffle=True, seed=0) for xy in tensors]
    hand = [Indexed(x, y, args.batch_size) for x, y in tensors]
    measure("Linear, in-memory loaders", linear, hand, args.reps, own)
    fits = [DataLoader(Batches(batches[:75]), batch_size=None)]  # whole fits: per-fit costs
    measure("Linear, 75-step fits (whole)", linear, fits, args.reps)


if __name__ == "__main__":
    main()
