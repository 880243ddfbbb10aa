"""The fast in-memory path vs the default DataLoader, and padding with/without bucketing.

    .venv/bin/python benchmarks/data_loading.py [--reps 5]

1. Batches/s on the tutorial workload: 60,000 x 1x28x28 float32, batch 64, shuffled:
   ``torch.utils.data.DataLoader(TensorDataset)`` (per-sample ``__getitem__`` + collate) vs
   :class:`glassloop.data.InMemoryLoader` (``X[idx]`` per batch). Alternating full epochs.
2. End-to-end epoch time of the default ``glassloop train`` (tutorial MLP, bundled MNIST
   subset, batch 64): the same Trainer with either loader.
3. Padding fraction of ``pad_collate`` batches for a generated corpus (log-normal lengths),
   with and without :class:`glassloop.data.BucketBatchSampler`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from glassloop import build, load_config
from glassloop.data import InMemoryLoader, make_loader, pad_collate
from glassloop.data.text import padding_fraction


def timed_epoch(loader: Iterable[Any]) -> tuple[float, int]:
    start = time.perf_counter()
    n = sum(1 for _ in loader)
    return time.perf_counter() - start, n


def loader_throughput(reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60_000, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (60_000,), generator=g)
    default = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=g)
    fast = InMemoryLoader((x, y), batch_size=64, shuffle=True, seed=0)
    times: dict[str, list[float]] = {"DataLoader": [], "InMemoryLoader": []}
    batches = 0
    for _ in range(reps):
        for name, loader in (("DataLoader", default), ("InMemoryLoader", fast)):
            t, batches = timed_epoch(loader)
            times[name].append(t)
    base = statistics.median(times["DataLoader"])
    print("1. loader alone, 60,000 x 1x28x28, batch 64, shuffled")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"   {name:<15} {batches / t:10.0f} batches/s   speed-up {base / t:6.1f}x")


def end_to_end(reps: int) -> None:
    cfg = load_config(None, ["train.progress=none", "scheduler.name=none"])
    run = build(cfg)
    splits = run.splits
    slow = DataLoader(
        TensorDataset(splits.x_train, splits.y_train),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    fast = make_loader((splits.x_train, splits.y_train), batch_size=64, shuffle=True)
    times: dict[str, list[float]] = {"DataLoader": [], "InMemoryLoader": []}
    epoch = 0
    for _ in range(reps):
        for name, loader in (("DataLoader", slow), ("InMemoryLoader", fast)):
            epoch += 1
            start = time.perf_counter()
            run.trainer.fit(loader, run.val_loader, epochs=epoch)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["DataLoader"])
    print("2. glassloop train epoch (tutorial MLP, 4,000 MNIST images + 1,000 validation)")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"   {name:<15} {t:8.3f} s/epoch   speed-up {base / t:6.2f}x")


class Corpus(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.ones(self.lengths[i], dtype=torch.long), 0


def padding() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.empty(10_000).log_normal_(3.0, 0.8, generator=g).clamp(2, 512).long().tolist()
    corpus = Corpus(lengths)
    print(
        "3. padding of pad_collate batches, 10,000 texts, log-normal lengths "
        f"(median {int(statistics.median(lengths))}, max {max(lengths)}), batch 32"
    )
    for name, extra in (("random batches", {}), ("length buckets", {"lengths": lengths})):
        loader = make_loader(
            corpus, batch_size=32, shuffle=True, collate_fn=pad_collate, num_workers=0, **extra
        )
        print(f"   {name:<15} padding fraction {padding_fraction(list(loader)):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="alternating epochs per loader")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    loader_throughput(args.reps)
    end_to_end(args.reps)
    padding()


if __name__ == "__main__":
    main()
