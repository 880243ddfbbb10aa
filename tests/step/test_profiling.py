"""``profile=N``: a trace of N steps in RUN_DIR/profile and the top operators printed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from glassloop import Trainer


def test_profile_writes_a_trace_of_n_steps_and_prints_the_top_operators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        device="cpu", progress="none", run_dir=tmp_path / "run", profile=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    trainer.fit(list(zip(x.split(16), y.split(16), strict=True)), epochs=1)
    trace = json.loads((tmp_path / "run" / "profile" / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names  # the model's linear layers ran inside it
    out = capsys.readouterr().out
    assert "profile of 3 steps" in out and "Self CPU" in out
