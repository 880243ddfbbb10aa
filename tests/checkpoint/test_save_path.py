"""The path of a checkpoint save, held: the glassloop modules one save enters, from the loop's
call to the bytes (one process, synchronous, a local run directory). A reader following a
save opens these files and no others; the count is deterministic (a profile hook sees every
call), and a budget that only falls (issue 47: 14 before the folders, 16 after the first
cut, 13 once the save times, pruning and the global batch stopped taking a module each).

``python tests/checkpoint/test_save_path.py`` prints the modules in the order they are first
entered."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import glassloop

SAVE_PATH = 13  # modules; budgets only fall


def modules_a_save_enters(tmp: Path) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    model = nn.Linear(4, 2)
    trainer = glassloop.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=tmp / "run",
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
        try:
            saved = checkpointer.save()
        finally:
            sys.setprofile(None)
    assert saved is not None and (saved / "manifest.json").is_file()  # (a real save)
    return [m.removeprefix("glassloop.") for m in seen]


def test_a_save_enters_few_modules(tmp_path: Path) -> None:
    seen = modules_a_save_enters(tmp_path)
    assert len(seen) <= SAVE_PATH, f"{len(seen)} modules: {', '.join(seen)}"
    assert "run_dir.local_store" in seen and "storage.hashed_files" in seen  # (it did save)


if __name__ == "__main__":
    import tempfile

    found = modules_a_save_enters(Path(tempfile.mkdtemp()))
    print(len(found), "modules:", ", ".join(found))
