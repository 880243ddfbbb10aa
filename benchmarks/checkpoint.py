"""Checkpoint save/load time and size for the default run (tutorial MLP, AdamW, mnist-5k).

    .venv/bin/python benchmarks/checkpoint.py [--reps 10]

Trains one epoch so the optimizer state is populated, then times ``trainer.checkpointer.save()``
(write + fsync + SHA-256 manifest + atomic rename) and a full resume load (manifest and hash
verification, header checks, weights into the model, optimizer/scheduler/RNG/loop state).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from glassloop import build, load_config
from glassloop.checkpoint.resume import check_training_state
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.storage.weights import load_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed saves and loads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        run_dir = Path(tmp) / "run"
        cfg = load_config(None, ["train.epochs=1", "train.progress=none"])
        run = build(cfg, run_dir=run_dir)
        trainer = run.trainer
        trainer.fit(run.train_loader, run.val_loader, epochs=1)
        saves, loads = [], []
        path = None
        for _ in range(args.reps):
            start = time.perf_counter()
            path = trainer.checkpointer.save()  # fit handed it its parts
            saves.append(time.perf_counter() - start)
            assert path is not None
            start = time.perf_counter()
            checkpoint = read_checkpoint(path, check_training_state)
            load_weights(trainer.model, checkpoint.weights)
            trainer.load_state_dict(checkpoint.state)
            loads.append(time.perf_counter() - start)
        assert path is not None
        sizes = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
        total = sum(sizes.values())
        print(f"checkpoint of the default run at step {trainer.state.step}: {path.name}")
        for name, size in sizes.items():
            print(f"  {name:<20} {size:>10,d} bytes")
        print(f"  {'total':<20} {total:>10,d} bytes ({total / 2**20:.2f} MiB)")
        print(f"save (median of {args.reps}): {1e3 * statistics.median(saves):.1f} ms")
        print(f"load + verify (median of {args.reps}): {1e3 * statistics.median(loads):.1f} ms")


if __name__ == "__main__":
    main()
