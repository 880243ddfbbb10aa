"""Which glassloop modules one checkpoint save enters, from the loop's call to the bytes: one
process, synchronous, a local run directory (issue 47's "path of a checkpoint save"). Prints
the modules in the order they are first entered, and their count; deterministic.

    .venv/bin/python benchmarks/save_path.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import glassloop


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    model = nn.Linear(4, 2)
    run = Path(tempfile.mkdtemp()) / "run"
    trainer = glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=run,
    )  # fmt: skip
    trainer.fit(data, epochs=1)
    checkpointer = trainer.checkpointer
    checkpointer.attach(trainer.stateful(), loader=data)
    seen: list[str] = []

    def entered(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("glassloop") and module not in seen:
            seen.append(module)

    with trainer.run.hold():
        sys.setprofile(entered)
        checkpointer.save()
        sys.setprofile(None)
    print(len(seen), "modules:", ", ".join(m.removeprefix("glassloop.") for m in seen))


if __name__ == "__main__":
    main()
