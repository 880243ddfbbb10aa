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


def imports_of(path: Path) -> set[str]:
    """glassloop modules that ``path`` imports anywhere (also inside functions), except under
    ``if TYPE_CHECKING:`` (type-only imports never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
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


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
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
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


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
