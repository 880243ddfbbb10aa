"""Throughput of `glassloop train` with 1 process vs N processes (DDP and FSDP2 via torchrun).

    .venv/bin/python benchmarks/ddp_scaling.py [--nproc 2] [--epochs 3]

The tutorial-sized MLP (784-512-512-10) on generated data (20,000 samples, 784 features),
batch 64 per process (so N processes take N times larger global steps: weak scaling). Reads
each epoch's samples/s from metrics.jsonl (rank 0 reports the whole job's samples) and prints
the median over epochs after the first. On CPU, torchrun gives each process one thread
(OMP_NUM_THREADS=1) while one process uses every core; on GPUs each process gets its own
device. The FSDP run shards the same model over the N processes (train.strategy = "fsdp"):
per step each process all-gathers every layer's weights twice (forward, backward) and
reduce-scatters the gradients, where DDP all-reduces the gradients once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """
[data]
name = "synthetic"
num_samples = 25000
num_features = 784
batch_size = 64
[model]
hidden = [512, 512]
[optim]
name = "SGD"
lr = 0.01
[scheduler]
name = "none"
[train]
progress = "none"
[checkpoint]
every_n_epochs = 0
"""


def run(
    workdir: Path, name: str, nproc: int, epochs: int, strategy: str = "auto"
) -> tuple[float, float]:
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    subprocess.run(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", *launch, "--run-dir", name,
         "--set", f"train.epochs={epochs}", "--set", f"train.strategy={strategy}"],
        cwd=workdir, check=True, capture_output=True, text=True,
    )  # fmt: skip
    rows = [
        json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()
    ]
    epochs_rows = [r for r in rows if r["kind"] == "epoch"][1:]  # the first warms up
    samples_per_s = statistics.median(r["samples_per_s"] for r in epochs_rows)
    steps = epochs_rows[0]["step"] - rows[[r["kind"] for r in rows].index("epoch")]["step"]
    steps_per_s = steps / statistics.median(r["seconds"] for r in epochs_rows)
    return samples_per_s, steps_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes for the DDP run")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "cfg.toml").write_text(CONFIG)
        one = run(workdir, "one", 1, args.epochs)
        many = run(workdir, "many", args.nproc, args.epochs)
        sharded = run(workdir, "fsdp", args.nproc, args.epochs, "fsdp")
    print(f"{'run':<16} {'samples/s':>10} {'steps/s':>8} {'vs 1 process':>13}")
    for label, (samples, steps) in (
        ("1 process", one),
        (f"{args.nproc} DDP", many),
        (f"{args.nproc} FSDP", sharded),
    ):
        print(f"{label:<16} {samples:>10.0f} {steps:>8.1f} {samples / one[0]:>12.2f}x")


if __name__ == "__main__":
    main()
