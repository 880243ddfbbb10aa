"""The README's "Your own step" example runs as written: in one process and under torchrun
with two processes; docs/python-api.md shows the same example."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from cli_runner import run_group

ROOT = Path(__file__).parents[2]


def example(page: str = "README.md") -> str:
    section = (ROOT / page).read_text(encoding="utf-8").split("# Your own step", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, f"no python block under {page}'s 'Your own step'"
    return found.group(1)


def test_the_api_page_shows_the_readme_example() -> None:
    assert example("docs/python-api.md") == example()


def test_the_readme_step_runs_in_one_process() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example(), "README.md", "exec"), {"__name__": "__main__"})
    loss = float(out.getvalue().split("train loss after 3 epochs: ")[1])
    assert loss < 1.0986  # below ln(3): it learned something


def test_the_readme_step_runs_with_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "step.py"
    script.write_text(example(), encoding="utf-8")
    done = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("train loss after 3 epochs:") == 2
