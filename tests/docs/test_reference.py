"""The site's generated reference pages (docs/gen_reference.py) against the code: the committed
docs/cli.md and docs/config.md are what the generator writes now; the config page names every
key of the schema with the default ``glassloop config`` prints (read back as TOML), its type
and a description from the docstring under its field; the CLI page names every command and
every flag of the parser."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomllib

from glassloop.cli.main import make_parser
from glassloop.config.schema import OPEN_SECTIONS, SECTIONS, from_dict, load_config, to_dict

DOCS = Path(__file__).resolve().parents[2] / "docs"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cells(line: str) -> list[str]:
    """A Markdown table row's cells (``\\|`` is a pipe within one)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def rows(page: str) -> dict[str, list[str]]:
    """The config page's key rows by their first cell (``section.key``)."""
    found = {}
    for line in page.splitlines():
        if line.startswith("| `") and "." in line.split("|")[1]:
            first, *rest = cells(line)
            found[first.strip("`")] = rest
    return found


@pytest.mark.parametrize("name", ["cli.md", "config.md"])
def test_the_committed_page_is_what_the_code_generates(name: str) -> None:
    expected = generator().PAGES[name]()
    assert (DOCS / name).read_text(encoding="utf-8") == expected, (
        f"docs/{name} differs from what the code generates: run python docs/gen_reference.py "
        "and commit it"
    )


def test_every_config_key_has_a_description_at_its_field() -> None:
    field_docs = generator().field_docs
    missing = [
        f"{section}.{f.name} ({cls.__module__}.{cls.__name__})"
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.name not in field_docs(cls)
    ]
    assert not missing, f"keys without a docstring under their field: {missing}"


def test_the_config_page_names_every_key_with_its_default_and_type() -> None:
    """Each key of the resolved default config (what ``glassloop config`` prints) has a row
    whose default reads back, as TOML, to that value; every row is a key of the schema."""
    page = (DOCS / "config.md").read_text(encoding="utf-8")
    found = rows(page)
    printed = to_dict(load_config(None))
    keys = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        assert f"\n## [{section}]\n" in page
        for f in dataclasses.fields(cls):
            if f.name == "kwargs" and section in OPEN_SECTIONS:
                continue
            key = f"{section}.{f.name}"
            keys.append(key)
            assert key in found, f"{key} is not in docs/config.md"
            type_cell, default, _, description = found[key]
            assert type_cell.strip("`") == generator().type_name(hints[f.name]), key
            assert toml_value(default) == printed[section][f.name], (key, default)
            assert description, key
    assert sorted(found) == sorted(keys), "docs/config.md has rows for keys the schema lacks"
    # [optim]'s other keys: the default optimizer's keyword arguments, as printed
    other = next(line for line in page.splitlines() if line.startswith("| any other key"))
    shown = cells(other)[2]
    extra = {k: v for k, v in printed["optim"].items() if k not in ("name", "lr")}
    extra.pop("no_decay_bias_norm")
    assert tomllib.loads("\n".join(re.findall(r"`([^`]+)`", shown))) == extra


def toml_value(cell: str) -> Any:
    return tomllib.loads(f"v = {cell.strip('`')}")["v"]


def test_the_config_pages_toml_examples_load_as_configs() -> None:
    page = (DOCS / "config.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```toml\n(.*?)```", page, re.DOTALL)
    assert blocks
    for block in blocks:
        from_dict(tomllib.loads(block))


def test_the_cli_page_names_every_command_and_flag() -> None:
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = {
        part.split("\n", 1)[0]: part for part in page.split("\n## ")[1:]
    }  # by heading: "glassloop train", ...
    commands = generator().subcommands(make_parser())
    assert len(commands) >= 9
    for name, (_, parser) in commands.items():
        section = sections.get(f"glassloop {name}")
        assert section is not None, f"docs/cli.md has no section for glassloop {name}"
        flags = {
            option
            for action in parser._actions
            for option in action.option_strings
            if option not in ("-h", "--help")
        }
        for flag in flags:
            assert re.search(rf"`{re.escape(flag)}[ `]", section), (name, flag)
