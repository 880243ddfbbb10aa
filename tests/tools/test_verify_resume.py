"""glassloop verify-resume: exact resume proved on this machine, in three processes (straight
through; killed with SIGKILL after step K; resumed), compared digest by digest."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
from cli_runner import run_glassloop

from glassloop.tools.verify_resume import digest

SMALL = [
    "--set", "data.name=synthetic", "--set", "data.num_samples=320", "--set", "data.batch_size=32",
    "--set", "data.num_features=8", "--set", "model.hidden=[16]", "--set", "train.epochs=2",
    "--set", "checkpoint.every_n_steps=3", "--set", "train.progress=none",
]  # fmt: skip


README_LINE = next(
    line.split("  #")[0]
    for line in (Path(__file__).parents[2] / "docs" / "checkpoints.md")
    .read_text(encoding="utf-8")
    .splitlines()
    if line.startswith("glassloop verify-resume ")
)  # (the docs' block test leaves this line to this test: each run costs ~14 s)


def test_verify_resume_proves_an_exact_resume(tmp_path: Path) -> None:
    """docs/checkpoints.md's command as written (digits, killed mid-epoch after step 12, the last
    checkpoint at step 10), resumed: every digest identical, exit 0; with --keep, both
    runs kept."""
    words = shlex.split(README_LINE)
    assert words[:2] == ["glassloop", "verify-resume"]
    done = run_glassloop(*words[1:], "--keep", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.splitlines()
    for name in ("weights", "optimizer", "other state", "rng", "numbers"):
        row = next(line for line in table if line.startswith(name))
        assert row.endswith("identical"), row
    assert "resume is exact" in done.stdout
    assert sorted((tmp_path / "killed" / "checkpoints").glob("step-*"))
    assert (tmp_path / "straight" / "model.safetensors").is_file()


def test_a_kill_after_the_last_step_is_one_line(tmp_path: Path) -> None:
    """Said as soon as the straight run shows its last step, before a second run."""
    done = run_glassloop("verify-resume", *SMALL, "--kill-at", "1000", "--keep", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "glassloop: error: verify-resume: the run ended before step 1000; choose a smaller "
        "--kill-at"
    ]
    assert done.stdout.splitlines() == ["verify-resume: straight through ..."]
    assert not (tmp_path / "killed").exists()


def test_a_digest_sees_one_ulp_and_the_structure() -> None:
    """What makes a DIFFERENT row possible: one bit of one tensor, a number, a dtype."""
    state = {"w": torch.ones(3), "step": 4}
    changed = {"w": torch.ones(3), "step": 4}
    changed["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert digest(state) != digest(changed)
    assert digest(state) != digest({"w": torch.ones(3), "step": 5})
    assert digest(state) != digest({"w": torch.ones(3, dtype=torch.float64), "step": 4})
    assert digest(state) == digest({"step": 4, "w": torch.ones(3)})
