"""benchmarks/gpu_check.py runs on CPU (--device cpu --quick): the GPU check is ready for the
day a GPU is lent, and its correctness rows (fp16 + GradScaler, kill -9 + resume) pass here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_on_cpu_and_its_correctness_rows_pass(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], cwd=tmp_path,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): line for line in table}
    for check in (
        "overhead tutorial MLP 32", "overhead small CNN bf16", "bf16 speed-up over fp32 (hand loop, MLP)",
        "fp16 + GradScaler", "torch.compile", "in-memory loader on the device vs pinned DataLoader",
        "kill -9 mid-run + resume (deterministic)", "overhead small GPT (0.1M) bf16",
        "small GPT (0.1M) bf16 eager, glassloop", "host syncs, default fit (MLP, one epoch)",
    ):  # fmt: skip
        assert check in rows, f"no row {check!r} in\n{done.stdout}"
    assert rows["fp16 + GradScaler"].rstrip().endswith("| ok |")
    # No read of a value per step (the hand loop reads none): a few at the epoch's end.
    assert rows["host syncs, default fit (MLP, one epoch)"].rstrip().endswith("| ok |")
    assert (
        "killed: True, final weights bitwise equal: True | ok"
        in rows["kill -9 mid-run + resume (deterministic)"]
    )
