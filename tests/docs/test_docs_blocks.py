"""Every code block in README.md and docs/ runs as written: a user copies it before reading
the prose around it. The README's blocks run in order in one empty directory, as a new user
would type them; a TOML block must load as a config. The few blocks that cannot run here are
listed in NOT_RUN with the reason (docs/tasks.md has its own test, test_doc_examples.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from cli_runner import run_glassloop, run_python
from s3_server import local_s3

from glassloop.config.schema import from_dict

ROOT = Path(__file__).parents[2]
FILES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/python-api.md",
         "docs/training.md", "docs/checkpoints.md", "docs/tools.md", "docs/guarantees.md",
         "docs/exit-codes.md", "docs/development.md", "docs/datasets.md", "docs/distributed.md",
         "docs/recipes.md", "docs/benchmarks.md", "docs/tracking.md", "docs/storage.md", "docs/search.md"]  # fmt: skip
S3_DOCS = "docs/storage.md"  # its blocks run against a local S3 server (tests/s3_server.py)
# Blocks not run, by file and their first line (or a line of the block), with the reason.
NOT_RUN = {
    (
        "README.md",
        "make demo",
    ): "the set-up commands themselves: CI runs make test in a fresh clone",
    ("docs/getting-started.md", "make demo   #"): "the set-up commands themselves, as in the "
    "README",
    ("docs/getting-started.md", "make demo PIP_ARGS"): "installs torch from another index "
    "(network)",
    ("README.md", "class L1Trainer"): "test_readme_step.py runs it, in one process and two",
    ("README.md", "glassloop data shard"): "needs a bucket: docs/storage.md runs the same "
    "three lines against a local S3 server",
    ("docs/python-api.md", "class L1Trainer"): "the README's example: test_readme_step.py holds "
    "the two the same",
    ("docs/checkpoints.md", "glassloop verify-resume --set"): "test_verify_resume.py runs it as "
    "written (with --keep, to look at both runs)",
    ("docs/development.md", "GLASSLOOP_MATRIX=full"): "the whole matrix takes about 15 minutes; "
    "make test runs its diagonal",
    ("docs/distributed.md", "# on node0"): "needs two machines",
    ("docs/distributed.md", "#SBATCH"): "needs a SLURM cluster",
    ("docs/distributed.md", "torchrun --standalone --nproc-per-node 4"): "four processes: "
    "getting-started.md runs the same command with --nproc 2",
    ("docs/distributed.md", "kubectl apply"): "needs a Kubernetes cluster",
    ("docs/distributed.md", "--max-restarts 3"): "eight processes: test_distributed.py "
    "runs torchrun's restarts with two",
    ("docs/distributed.md", "TorchTrainer("): "tests/distributed/test_ray_train.py runs it "
    "on the Ray cluster it starts",
    ("docs/recipes.md", "recipes/NAME.toml"): "a template: test_recipes.py trains the recipes",
    ("docs/datasets.md", "from glassloop.data import make_loader, pad_collate"): "an API "
    "sketch over your own data; test_loaders.py checks each call",
    ("docs/tracking.md", "pip install 'glassloop[mlflow]'"): "installs (network); the dev "
    "extra has mlflow",
    ("docs/tracking.md", "pip install 'glassloop[wandb]'"): "installs (network); the dev "
    "extra has wandb",
    ("docs/storage.md", "pip install 'glassloop[cloud]'"): "installs (network); the dev "
    "extra has s3fs",
    ("docs/search.md", "--backend ray"): "needs a Ray cluster and a shared folder: "
    "tests/tuning/test_tune_ray.py runs the command on the Ray cluster it starts",
}
BENCHMARKS = "benchmarks/"  # run by hand (minutes each); their results are in benchmarks.md


def blocks(name: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block with a language."""
    text = (ROOT / name).read_text(encoding="utf-8")
    return re.findall(r"^```(\w+)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def not_run(name: str, code: str) -> str | None:
    for (file, marker), why in NOT_RUN.items():
        if file == name and marker in code:
            return why
    return "benchmarks are run by hand" if BENCHMARKS in code else None


def test_every_block_is_run_or_listed_with_a_reason() -> None:
    used = {
        (file, marker)
        for file in FILES
        for _, code in blocks(file)
        for (f, marker) in NOT_RUN
        if f == file and marker in code
    }
    assert used == set(NOT_RUN), f"stale NOT_RUN entries: {set(NOT_RUN) - used}"
    for file in FILES:
        for language, _ in blocks(file):
            assert language in ("bash", "python", "toml"), f"{file}: a {language} block"


@pytest.mark.parametrize("name", [*FILES, "docs/tasks.md"])
def test_every_fence_closes_bare(name: str) -> None:
    """A closing fence with text after it does not close the block on GitHub: the rest of
    the page would render as code (the README's "Benchmarks live in ..." once did)."""
    fences = [line for line in (ROOT / name).read_text(encoding="utf-8").splitlines()
              if line.startswith("```")]  # fmt: skip
    assert fences[1::2] == ["```"] * len(fences[1::2]), name
    assert all(re.fullmatch(r"```\w*", line) for line in fences[::2]), name


@pytest.mark.parametrize("name", FILES)
def test_toml_blocks_are_valid_configs(name: str) -> None:
    for language, code in blocks(name):
        if language == "toml":
            from_dict(tomllib.loads(code))  # raises ConfigError with the key at fault


def run_line(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One command line: plain ``glassloop`` commands in this process (the console script's
    ``main``, fast); anything with shell syntax, ``--nproc`` or ``python`` in a real shell."""
    words = shlex.split(line, comments=True)
    plain = not re.search(r"[;|&<>$`]", line.split("#")[0]) and "--nproc" not in words
    if plain and words and words[0] == "glassloop":
        return run_glassloop(*words[1:], cwd=cwd)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip


def run_block(language: str, code: str, cwd: Path) -> str:
    """Runs one block; a Python block's standard output."""
    if language == "python":
        done = run_python(code, cwd)
        assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"
        return done.stdout
    for line in code.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        done = run_line(line, cwd)
        assert done.returncode == 0, f"$ {line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return ""


def test_readme_blocks_run_in_order(tmp_path: Path) -> None:
    for language, code in blocks("README.md"):
        if language != "toml" and not not_run("README.md", code):
            run_block(language, code, tmp_path)
    assert (tmp_path / "runs" / "mlp" / "model.safetensors").is_file()


def test_getting_started_runs_in_order(tmp_path: Path) -> None:
    """Every command of the walk-through, in order, in one empty directory; it ends where the
    page says it does (it once ended at 82.5%)."""
    page = "docs/getting-started.md"
    for language, code in blocks(page):
        if language != "toml" and not not_run(page, code):
            run_block(language, code, tmp_path)
    assert (tmp_path / "runs" / "lr1e-2" / "report" / "index.html").is_file()
    rows = (tmp_path / "runs" / "lr1e-2" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(row) for row in rows if '"kind": "epoch"' in row][-1]
    text = (ROOT / page).read_text(encoding="utf-8")
    assert f"final validation accuracy: {100 * last['val_accuracy']:.2f}%" in text


def test_every_test_file_the_docs_name_exists() -> None:
    """A guarantee points at the test that holds it: a moved or renamed test file must not
    leave the docs pointing at nothing (the README once named test_resume.py without its
    folder)."""
    for name in [*FILES, "docs/tasks.md", "docs/architecture.md"]:
        text = (ROOT / name).read_text(encoding="utf-8")
        for path in re.findall(r"`(tests/[\w/]+\.py)", text):
            assert (ROOT / path).is_file(), f"{name} names {path}, which does not exist"
        for bare in re.findall(r"`(test_\w+\.py)`", text):
            assert any(ROOT.glob(f"tests/**/{bare}")), f"{name} names {bare}: no such test"


def test_every_page_with_code_has_its_blocks_run() -> None:
    """A new page's blocks run from the day it is added: every docs page with a bash, python
    or toml block is in FILES, or in the test that runs it (tasks.md: test_doc_examples.py;
    the generated config.md: test_reference.py; notebooks.md, the quick-start notebook's
    cells: test_notebook.py)."""
    own_tests = {"docs/tasks.md", "docs/config.md", "docs/notebooks.md"}
    for page in sorted((ROOT / "docs").glob("*.md")):
        name = f"docs/{page.name}"
        if any(language in ("bash", "python", "toml") for language, _ in blocks(name)):
            assert name in FILES or name in own_tests, f"{name}'s code blocks are never run"


def test_the_readme_links_resolve() -> None:
    """The README is read on GitHub, outside the site's strict build: each of its relative
    links names a file of the repository (and an anchor its page has)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


@pytest.mark.parametrize(
    "name", [f for f in FILES if f not in ("README.md", "docs/getting-started.md", S3_DOCS)]
)
def test_docs_blocks_run(name: str, tmp_path: Path) -> None:
    for language, code in blocks(name):
        if language != "toml" and not not_run(name, code):
            run_block(language, code, tmp_path)


def test_storage_blocks_run_against_a_local_s3(tmp_path: Path) -> None:
    """docs/storage.md's bucket is a real S3 server on 127.0.0.1, reached as a user's
    AWS_* variables would reach theirs; the run lands in it. The ``memory://`` example
    prints what the page says it prints (what it trained, what landed in the bucket)."""
    page = (ROOT / S3_DOCS).read_text(encoding="utf-8")
    with local_s3("my-bucket"):
        for language, code in blocks(S3_DOCS):
            if language != "toml" and not not_run(S3_DOCS, code):
                printed = run_block(language, code, tmp_path)
                if printed:
                    assert f"```\n{printed}```" in page, printed
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.invalidate_cache()
        assert fs.exists("my-bucket/mnist/model.safetensors")
        assert fs.exists("my-bucket/mnist/checkpoints/latest")
