"""The package's shape, checked from its source: no import cycles, nothing imports upward
into the package root or the CLI, the loop does not read the config, and the command starts
without torch or scikit-learn."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import glassloop

PACKAGE = Path(glassloop.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, *, type_only_too: bool = True) -> set[str]:
    """glassloop modules that ``path`` imports anywhere (also inside functions), also under
    ``if TYPE_CHECKING:`` (a type-only import is a dependency a reader follows all the same)
    unless ``type_only_too`` is false."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if not type_only_too
        and isinstance(block, ast.If)
        and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    this = module_name(path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("glassloop")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = this.split(".")[: -node.level] if path.name != "__init__.py" else this
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("glassloop"):
                found.add(target)
    return found - {this}


def graph(*, type_only_too: bool = True) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path, type_only_too=type_only_too):
            # "from glassloop.data import x" names the package glassloop.data (its __init__)
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            targets.add(imported)
        edges[name] = targets - {name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_there_is_no_import_cycle() -> None:
    """Counting imports under ``if TYPE_CHECKING:`` too (the package root's lazy exports are
    the one place that names everything, and nothing imports the root)."""
    edges = graph()
    edges.pop("glassloop", None)
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_type_only_imports_are_counted() -> None:
    """callbacks.py once imported the Trainer under TYPE_CHECKING: the graph sees such an
    import (and the runtime-only graph does not)."""
    probe = PACKAGE / "lr_finder.py"  # annotates with the Trainer, imported for types only
    assert "glassloop.loop" in imports_of(probe)
    assert "glassloop.loop" not in imports_of(probe, type_only_too=False)


# The loop's parts: what they need of a trainer is a Protocol of their own, or values.
COMPONENTS = (
    "glassloop.run_log", "glassloop.summary", "glassloop.callbacks", "glassloop.checkpointer",
    "glassloop.checkpoint", "glassloop.report", "glassloop.tracking", "glassloop.parallelize",
    "glassloop.evaluation", "glassloop.guards", "glassloop.state", "glassloop.sinks",
    "glassloop.parts", "glassloop.validator",
)  # fmt: skip


def test_no_component_imports_the_loop() -> None:
    edges = graph()
    for component in COMPONENTS:
        assert "glassloop.loop" not in edges[component], f"{component} imports the loop"


# Each owns its section of the config; glassloop.config composes them.
SECTION_OWNERS = (
    "glassloop.data.options", "glassloop.models", "glassloop.optimizers", "glassloop.losses",
    "glassloop.checkpointer", "glassloop.tracking",
)  # fmt: skip


def test_the_config_schema_is_composed_not_imported_downward() -> None:
    """config.py imports the sections' dataclasses from their owners; no owner (nor anything
    under data/) imports config.py."""
    edges = graph()
    for name, targets in edges.items():
        if name in SECTION_OWNERS or name.startswith("glassloop.data"):
            assert "glassloop.config" not in targets, f"{name} imports glassloop.config"
    assert set(SECTION_OWNERS) <= edges["glassloop.config"]


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_upward() -> None:
    """Into the package root (which would import every public name) or the CLI."""
    for name, targets in graph().items():
        if name in ("glassloop", "glassloop.__main__") or name.startswith("glassloop.cli"):
            continue  # the package's lazy exports and the command's entry points
        assert "glassloop" not in targets, f"{name} imports the package root"
        assert not any(t.startswith("glassloop.cli") for t in targets), f"{name} imports the CLI"


def test_the_loop_does_not_read_the_config() -> None:
    assert "glassloop.config" not in graph()["glassloop.loop"]


def test_the_command_starts_without_torch_or_sklearn() -> None:
    probe = (
        "import sys, tempfile; from glassloop.cli.main import main\n"
        "empty = tempfile.mkdtemp()\n"
        "for argv in (['--help'], ['--version'], ['train', '--help'], ['runs', empty]):\n"
        "    try: main(argv)\n"
        "    except SystemExit: pass\n"
        "heavy = sorted(m for m in ('torch', 'sklearn', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "HEAVY []" in out, out


def test_storage_never_reaches_up_into_fsdp() -> None:
    """checkpoint.py (and atomic.py) store bytes; what is sharded is handed to them."""
    edges = graph()
    for storage in ("glassloop.checkpoint", "glassloop.atomic"):
        assert "glassloop.fsdp" not in edges[storage], storage


# tinygrad's size budget for the core (STYLE.md), in lines as `wc -l` counts them. The loop
# proper is Trainer.fit down to _stop_if_signalled, read contiguously; loop.py is the loop,
# parts.py its base (the constructor and the methods around the loop, each one call into a
# component). atomic.py: durable writes and the link-safe delete, by descriptors.
FILE_BUDGETS = {
    "loop.py": 450, "parts.py": 300, "checkpoint.py": 500, "weights.py": 270, "atomic.py": 155,
}  # fmt: skip
LOOP_PROPER = ("fit", "_stop_if_signalled", 330)
TRAIN_STEP = 55


def lines_of_methods(first: str, last: str) -> int:
    """Lines of ``Trainer`` from ``def first`` to the end of ``def last``, which must come
    after it in the file (the loop read top to bottom)."""
    tree = ast.parse((PACKAGE / "loop.py").read_text(encoding="utf-8"))
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    start = methods[first].decorator_list[0].lineno if methods[first].decorator_list else None
    begin, end = start or methods[first].lineno, methods[last].end_lineno
    assert end is not None and end >= begin, f"{last} comes before {first} in loop.py"
    return end - begin + 1


def test_the_core_keeps_its_size_budget() -> None:
    over = {
        name: lines
        for name, budget in FILE_BUDGETS.items()
        if (lines := len((PACKAGE / name).read_text(encoding="utf-8").splitlines())) > budget
    }
    assert not over, f"over budget (lines): {over}; budgets: {FILE_BUDGETS}"
    first, last, budget = LOOP_PROPER
    assert lines_of_methods(first, last) <= budget
    assert lines_of_methods("train_step", "train_step") <= TRAIN_STEP
