"""Every Python block in docs/tasks.md runs as written (a user copies it before reading the
prose around it), each in a fresh interpreter in an empty directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_python

DOCS = Path(__file__).parents[2] / "docs"


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """``(heading, code)`` of every ```python block, named by the section it is in (a
    ``# comment`` inside any block is code, not a heading)."""
    blocks, heading, fence, code = [], path.name, "", []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if fence and line.rstrip() == "```":  # a block ends
            if fence == "```python":
                blocks.append((heading, "".join(code)))
            fence, code = "", []
        elif fence:
            code.append(line)
        elif line.startswith("```"):
            fence = line.strip()
        elif line.startswith("#"):
            heading = line.lstrip("# ").strip()
    return blocks


TASKS = python_blocks(DOCS / "tasks.md")
EXPECTED = {  # what each example must print: it ran, and it learned
    "Regression (scikit-learn's diabetes set)": "regression",
    "Multi-label tagging": "exact match",
    "A language model (characters of a generated corpus)": "perplexity",
    "A model that computes its own loss (Hugging Face style)": "val accuracy",
    "Several heads, your own metrics, step hooks": "val_size_mae",
    "A step that keeps state: truncated BPTT with a carried hidden state": "carried state resumed exactly: True",
    "An optimizer that takes a closure (LBFGS)": "train_loss",
    "Several models and optimizers: a GAN": "generated mean",
    "Several validation sets": "shifted",
    "Two inputs, and the knobs of a long run": "same class:",
    "Finding a learning rate": "suggested lr",
    "Saving and reloading a model built in Python": "True",
    "Fine-tuning with LoRA: adapter checkpoints, a resume, Hugging Face export": "the exported adapter computes the same logits: True",
}


def test_every_example_is_checked() -> None:
    assert sorted(name for name, _ in TASKS) == sorted(EXPECTED)


@pytest.mark.parametrize(("heading", "code"), TASKS, ids=[name for name, _ in TASKS])
def test_docs_tasks_example_runs(heading: str, code: str, tmp_path: Path) -> None:
    done = run_python(code, tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert EXPECTED[heading] in done.stdout, done.stdout
    # a user copying it sees no library's deprecation noise (the LoRA one printed three)
    assert "FutureWarning" not in done.stderr and "DeprecationWarning" not in done.stderr, (
        done.stderr[-3000:]
    )
