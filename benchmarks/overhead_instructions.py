"""glassloop's per-step overhead against the hand-written loop, in CPU instructions: counted by
valgrind's callgrind, which gives the same count for the same run whatever else the machine
is doing (wall-clock ratios on a shared 2-core VM moved by +-10% between identical runs).

    OMP_NUM_THREADS=1 python benchmarks/overhead_instructions.py [--mlp]   # valgrind; ~10 min

For each workload of benchmarks/peers.py (the tutorial MLP and Linear(784, 10), SGD, batch 64,
one DataLoader over pre-made batches) and each of the hand loop and glassloop, a process runs
a short and a long epoch; (long - short) / extra steps is the marginal count of one step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SHORT, LONG = 20, 100
CHILD = """
import sys, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
from peers import data, glassloop_fit, hand
fn = {{"hand": hand, "glassloop": glassloop_fit}}[sys.argv[1]]
fn(sys.argv[2], data(int(sys.argv[3])))
"""


def instructions(which: str, kind: str, steps: int) -> int:
    code = CHILD.format(here=str(Path(__file__).parent))
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-c", code, which, kind, str(steps)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1))


def main() -> None:
    kinds = ["linear", "mlp"] if "--mlp" in sys.argv else ["linear"]  # (the MLP: ~1 h)
    for kind in kinds:
        per_step = {}
        for which in ("hand", "glassloop"):
            short, long = instructions(which, kind, SHORT), instructions(which, kind, LONG)
            per_step[which] = (long - short) / (LONG - SHORT)
        hand, ours = per_step["hand"], per_step["glassloop"]
        print(f"{kind}: hand {hand / 1e3:,.0f}k instructions/step, glassloop {ours / 1e3:,.0f}k, "
              f"ratio {ours / hand:.3f} (+{(ours - hand) / 1e3:,.0f}k)")  # fmt: skip


if __name__ == "__main__":
    main()
