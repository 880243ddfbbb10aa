"""Start-up time of the glassloop command against a bare Python start and ``import torch``,
measured in the same run (each command started fresh, alternating, median of ``--reps``).

    .venv/bin/python benchmarks/startup.py [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "glassloop --help": [sys.executable, "-m", "glassloop", "--help"],
    "glassloop --version": [sys.executable, "-m", "glassloop", "--version"],
    "glassloop runs (empty dir)": [sys.executable, "-m", "glassloop", "runs", "."],
    'python -c "import glassloop"': [sys.executable, "-c", "import glassloop"],
    'python -c "from glassloop import Trainer"': [
        sys.executable, "-c", "from glassloop import Trainer",
    ],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="fresh starts per command")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.reps):
        for name, command in COMMANDS.items():  # alternating: drift hits every command
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, check=False)
            times[name].append(time.perf_counter() - start)
    bare = statistics.median(times["python -c pass"])
    torch_ = statistics.median(times['python -c "import torch"'])
    print(f"{'command':<44}{'median s':>10}{'- bare s':>10}{'/ torch':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<44}{median:>10.3f}{median - bare:>10.3f}{median / torch_:>9.2f}")


if __name__ == "__main__":
    main()
