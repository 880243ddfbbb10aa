"""glassloop's per-step overhead against the hand-written loop, in CPU instructions: counted by
valgrind's callgrind, which gives the same count for the same run whatever else the machine
is doing (wall-clock ratios on a shared 2-core VM moved by +-10% between identical runs).

    OMP_NUM_THREADS=1 python benchmarks/overhead_instructions.py [--linear] [--mlp]

Default workload: ``Linear(4, 2)``, batch 4, SGD, one ``DataLoader(batch_size=None)`` over
pre-made batches: a step so small that the framework's own per-step work is what is counted
(~10 min). ``--linear`` / ``--mlp`` add the workloads of benchmarks/peers.py (an hour or
more under valgrind). For each of the hand loop and glassloop a process runs a short and a
long epoch; (long - short) / extra steps is the marginal count of one step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, torch
from torch import nn
from torch.utils.data import DataLoader
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
from peers import Batches, data, glassloop_fit, hand
import glassloop
which, kind, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind != "tiny":
    {{"hand": hand, "glassloop": glassloop_fit}}[which](kind, data(steps))
    raise SystemExit
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g))
           for _ in range(steps)]
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()
loader = DataLoader(Batches(batches), batch_size=None)
if which == "hand":
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
else:
    glassloop.Trainer(model, optimizer, loss_fn, device="cpu", progress="none").fit(
        loader, epochs=1)
"""
STEPS = {"tiny": (200, 1200), "linear": (20, 100), "mlp": (20, 100)}


def instructions(which: str, kind: str, steps: int) -> int:
    code = CHILD.format(here=str(Path(__file__).parent))
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-c", code, which, kind, str(steps)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},  # (same dict probes)
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1))


def main() -> None:
    kinds = ["tiny"] + [k for k in ("linear", "mlp") if f"--{k}" in sys.argv]
    for kind in kinds:
        short, long = STEPS[kind]
        per_step = {}
        for which in ("hand", "glassloop"):
            extra = instructions(which, kind, long) - instructions(which, kind, short)
            per_step[which] = extra / (long - short)
        hand, ours = per_step["hand"], per_step["glassloop"]
        print(f"{kind}: hand {hand:,.0f} instructions/step, glassloop {ours:,.0f}, "
              f"ratio {ours / hand:.3f} (+{ours - hand:,.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
