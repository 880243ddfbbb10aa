"""How long a stop signal takes to land a checkpoint, from real `glassloop train` processes.

    .venv/bin/python benchmarks/preemption_grace.py --stops 10 --seed 7

A run of the preemption test's config (tests/checkpoint/test_preemption.py: 480 training
samples, a validation of 10 batches every 5 steps and at each epoch's end, the model pausing
10 ms in each forward) is started, sent SIGTERM at a random moment after its start header
(every other stop: just after a validation has begun), SIGKILLed if it is still there 3 s
later, and resumed with the same command, ``--stops`` times. Per stop: the step it stopped
after, the save's own seconds (from its message), the time from the signal to that message
(the checkpoint committed) and to the process's exit, and whether the SIGKILL was needed.
Prints a markdown table and the maxima for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
GRACE_S = 3.0


def one_stop(folder: Path, resume: bool, in_validation: bool, delay: float) -> dict[str, object]:
    command = [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--run-dir", "cut"]
    env = {**os.environ, "PAUSE_S": "0.01", "EVAL_PAUSE_S": "0.01"}
    proc = subprocess.Popen(
        [*command, *(["--resume"] if resume else [])],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[str] = []
    message_at: list[float] = []

    def read() -> None:
        for line in proc.stderr or ():
            errors.append(line)
            if "stopped by" in line:
                message_at.append(time.perf_counter())

    reader = threading.Thread(target=read)
    reader.start()
    for line in proc.stdout:  # the header's last line: the handlers are in place
        if line.startswith("preemption:"):
            break
    while in_validation and "validating\n" not in errors:
        time.sleep(0.002)
    time.sleep(delay)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(GRACE_S)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        killed = True
    ended = time.perf_counter()
    proc.stdout.read()
    reader.join()
    stop = next(line for line in errors if "stopped by" in line)
    return {
        "moment": "in a validation" if in_validation else "random",
        "step": int(stop.split("after step ")[1].split(";")[0]),
        "save_s": float(stop.split(" in ")[1].split(" s;")[0]),
        "to_checkpoint_s": message_at[0] - sent,
        "to_exit_s": ended - sent,
        "sigkill": killed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    chosen = random.Random(args.seed)
    test = (ROOT / "tests/checkpoint/test_preemption.py").read_text(encoding="utf-8")
    config = re.search(r'CONFIG = """(.*?)"""', test, re.DOTALL)
    assert config is not None
    folder = Path(tempfile.mkdtemp(prefix="glassloop-grace-"))
    try:
        shutil.copy(ROOT / "tests/checkpoint/preemptible_model.py", folder / "preemptible.py")
        (folder / "cfg.toml").write_text(config.group(1), encoding="utf-8")
        rows = []
        for i in range(args.stops):
            in_validation = i % 2 == 1
            delay = chosen.uniform(0, 0.05) if in_validation else chosen.uniform(0, 0.4)
            rows.append(one_stop(folder, i > 0, in_validation, delay))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("| stop | moment | after step | save s | signal -> checkpoint s | signal -> exit s |")
    print("|---:|---|---:|---:|---:|---:|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['moment']} | {row['step']} | {row['save_s']:.2f} | "
              f"{row['to_checkpoint_s']:.3f} | {row['to_exit_s']:.2f} |")  # fmt: skip
    worst = {key: max(float(row[key]) for row in rows) for key in ("to_checkpoint_s", "to_exit_s")}
    killed = sum(bool(row["sigkill"]) for row in rows)
    print(f"\nmax signal -> checkpoint {worst['to_checkpoint_s']:.3f} s, signal -> exit "
          f"{worst['to_exit_s']:.2f} s; SIGKILL needed {killed} of {len(rows)}")  # fmt: skip


if __name__ == "__main__":
    main()
