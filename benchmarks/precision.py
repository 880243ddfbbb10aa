"""Step time of the tutorial MLP under train.precision "32", "bf16" and "fp16" (CPU or GPU).

    .venv/bin/python benchmarks/precision.py [--batch-size 64] [--reps 21] [--device auto]

Same in-memory batches, same model, each precision with its own copy; short epochs alternate
between the precisions so machine drift hits all of them. Prints µs/step and the ratio to
"32" (above 1: slower). On CPUs without native bf16/fp16 matrix units, autocast usually costs
time: it adds casts and runs the same fp32 kernels or slower emulated ones.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from glassloop import Trainer
from glassloop.config.models import mlp
from glassloop.device import resolve_device

PRECISIONS = ("32", "bf16", "fp16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="batch size")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed epoch")
    parser.add_argument("--reps", type=int, default=21, help="timed epochs per precision")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args()
    device = resolve_device(args.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps * args.batch_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (len(x),), generator=g).to(device)
    batches = list(zip(x.split(args.batch_size), y.split(args.batch_size), strict=True))
    torch.manual_seed(0)
    base = mlp((1, 28, 28), 10, [512, 512]).to(device)
    models = {p: copy.deepcopy(base) for p in PRECISIONS}
    optimizers = {p: torch.optim.AdamW(models[p].parameters(), lr=1e-3) for p in PRECISIONS}

    def epoch(precision: str) -> float:
        trainer = Trainer(
            models[precision],
            optimizers[precision],
            nn.CrossEntropyLoss(),
            device=device,
            progress="none",
            precision=precision,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.fit(batches, epochs=1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for p in PRECISIONS:
        epoch(p)  # warm-up
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for rep in range(args.reps):
        order = PRECISIONS if rep % 2 == 0 else PRECISIONS[::-1]
        for p in order:
            times[p].append(epoch(p))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, {name}, {torch.get_num_threads()} threads, "
        f"tutorial MLP, batch {args.batch_size}, AdamW"
    )
    base_time = statistics.median(times["32"])
    for p in PRECISIONS:
        t = statistics.median(times[p])
        print(f"{p:>5}: {1e6 * t / args.steps:8.1f} us/step   ratio to 32: {t / base_time:.2f}")


if __name__ == "__main__":
    main()
