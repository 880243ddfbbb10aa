"""CHANGELOG.md keeps the Keep a Changelog 1.1.0 form (https://keepachangelog.com), and every
name glassloop still accepts with a DeprecationWarning is under Deprecated with its
replacement: a deprecation added without an entry fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import glassloop
from glassloop.deprecated import REPLACED

ROOT = Path(__file__).parents[2]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
VERSION = re.compile(r"\[Unreleased\]|\[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}")
# "- 2026-12-01: `Trainer(compile_mode=...)`: use `compile={"mode": ...}`."
ENTRY = re.compile(r"^- (?:\d{4}-\d{2}-\d{2}: )?`(?P<old>[^`]+)`: use `(?P<new>[^`]+)`", re.M)


def sections() -> list[tuple[str, str, str]]:
    """``(version, kind, text)`` of every ``###`` section, in the file's order."""
    found = []
    for version_block in re.split(r"^## ", CHANGELOG, flags=re.M)[1:]:
        version = version_block.splitlines()[0]
        for kind_block in re.split(r"^### ", version_block, flags=re.M)[1:]:
            kind, _, text = kind_block.partition("\n")
            found.append((version, kind.strip(), text))
    return found


def deprecated_entries() -> list[tuple[str, str]]:
    """``(old, new)`` of every entry under a Deprecated heading, quotes made alike."""
    return [
        (m["old"], m["new"].replace("'", '"'))
        for _, kind, text in sections()
        if kind == "Deprecated"
        for m in ENTRY.finditer(text)
    ]


def still_accepted() -> list[tuple[str, str]]:
    """``(name, replacement)`` of every deprecation in the package: the Trainer arguments of
    ``glassloop.deprecated.REPLACED`` and every ``warn_replaced(old, new)`` call."""
    found = [(name, new.replace("'", '"')) for name, new in REPLACED.items()]
    package = Path(glassloop.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("warn_replaced"):
                args = node.args
                assert len(args) == 2 and all(isinstance(a, ast.Constant) for a in args), (
                    f"{path.relative_to(package)}:{node.lineno}: warn_replaced takes two string "
                    "literals, so that this test can find the deprecation in CHANGELOG.md"
                )
                found.append((args[0].value, args[1].value.replace("'", '"')))
    return found


def test_the_changelog_has_the_keep_a_changelog_form() -> None:
    assert CHANGELOG.startswith("# Changelog\n")
    versions = re.findall(r"^## (.*)$", CHANGELOG, flags=re.M)
    assert versions[0] == "[Unreleased]", "## [Unreleased] comes first"
    assert all(VERSION.fullmatch(v) for v in versions), versions
    assert len(set(versions)) == len(versions), versions
    for version, kind, _ in sections():
        assert kind in KINDS, f"{version}: '### {kind}' is none of {sorted(KINDS)}"
    kinds = [(version, kind) for version, kind, _ in sections()]
    assert len(set(kinds)) == len(kinds), "a kind appears twice in one version"
    assert not re.search(r"^#{4,} ", CHANGELOG, flags=re.M), "no headings below ###"


def test_every_deprecation_still_accepted_is_under_deprecated() -> None:
    entries = deprecated_entries()
    missing = [
        f"{name} (use {new})"
        for name, new in still_accepted()
        if not any(
            re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", old) and replacement == new
            for old, replacement in entries
        )
    ]
    assert missing == [], f"CHANGELOG.md's Deprecated lacks: {missing}"


def test_the_deprecation_finder_finds_the_warn_replaced_calls() -> None:
    """The finder is not vacuous: the Trainer's save_checkpoint is found among them."""
    assert ("Trainer.save_checkpoint()", "trainer.checkpointer.save()") in still_accepted()
    assert len(still_accepted()) > len(REPLACED)
