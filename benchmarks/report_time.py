"""How long a run's report takes to write whatever the task's size: the end of a finished run
must never hang (a 1,024-class confusion matrix once drew for 32 minutes, a regression on
images scattered a million points), nor a run of a million steps (every step's loss plotted).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/report_time.py        # --reps 3

Each case trains nothing: a short real run gives the run directory (its curves), and the
evaluation is what glassloop's own metrics compute for that many classes
(``ClassificationSums``: the confusion matrix and class report are kept up to 1,024 classes,
so 50,000 classes report accuracy only), or a regression's outputs and targets, or a run
whose metrics.jsonl holds 1,000,000 steps' losses (one ``"kind": "losses"`` row). The time is
``write_report``'s, the minimum over ``--reps`` (each writes the whole report anew).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop import Trainer
from glassloop.evaluation.metrics import ClassificationSums
from glassloop.tracking.report import write_report


def run_dir(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    data = [(torch.randn(20, 6), torch.randint(0, 3, (20,))) for _ in range(5)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      device="cpu", progress="none", run_dir=root / "run")  # fmt: skip
    trainer.fit(data, data[:2], epochs=3)
    return root / "run"


def long_run(run: Path) -> Path:
    """A copy of ``run`` whose metrics.jsonl also holds a 1,000,000-step epoch's every loss."""
    longer = run.with_name("long")
    shutil.copytree(run, longer)
    rng = random.Random(0)
    losses = [1 / (1 + i / 1e5) + 0.1 * rng.random() for i in range(1_000_000)]
    row = {"kind": "losses", "epoch": 4, "step": 1_000_015, "first_step": 16, "loss": losses}
    with (longer / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    return longer


def classes(n: int, samples: int) -> dict[str, Any]:
    """The evaluation glassloop computes for ``samples`` predictions over ``n`` classes."""
    sums = ClassificationSums(n, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(samples // 100):
        labels = torch.randint(0, n, (100,), generator=g)
        scores = torch.randn(100, n, generator=g)
        scores[torch.arange(100), labels] += 3.0  # mostly right, as a trained model
        sums.update(scores, labels)
    return sums.compute()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory() as tmp:
        run = run_dir(Path(tmp))
        true = torch.rand(16, 1, 256, 256)  # 16 images' pixels: 1,048,576 points
        cases: list[tuple[str, Path, dict[str, Any]]] = [
            ("10 classes", run, {"evaluation": classes(10, 10_000)}),
            ("1,024 classes", run, {"evaluation": classes(1024, 20_000)}),
            ("50,000 classes", run, {"evaluation": classes(50_000, 1_000)}),
            ("regression, 1,048,576 points", run, {"predicted_vs_true": (true + 0.1, true)}),
            ("1,000,000 steps' losses", long_run(run), {}),
        ]
        write_report(run)  # (matplotlib's first import and font cache: not any case's)
        print(f"| report of | seconds (min of {reps}) |\n|---|---|")
        for name, where, kwargs in cases:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                write_report(where, **kwargs)
                times.append(time.perf_counter() - start)
            print(f"| {name} | {min(times):.2f} |")


if __name__ == "__main__":
    main()
