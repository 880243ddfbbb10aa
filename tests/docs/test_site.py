"""The documentation site builds as ``make docs`` builds it (``mkdocs build --strict``: a broken
link, a missing anchor or an API reference that does not resolve fails it), offline, with a
page for each entry of the nav; the config page names every key, the CLI page every command,
the API page every name ``glassloop`` exports. About 3 s."""

from __future__ import annotations

import dataclasses
import doctest
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import glassloop
from glassloop.cli.main import make_parser
from glassloop.config.schema import OPEN_SECTIONS, SECTIONS

ROOT = Path(__file__).resolve().parents[2]


def nav() -> dict[str, str]:
    """mkdocs.yml's nav: each title's page (one level: ``  - Title: page.md``)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    return dict(re.findall(r"^  - (.+): (\S+\.md)$", text, re.MULTILINE))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def page(site: Path, name: str) -> str:
    path = site / "index.html" if name == "index.md" else site / name[:-3] / "index.html"
    return path.read_text(encoding="utf-8")


def test_every_nav_entry_is_a_built_page_and_every_page_is_in_the_nav(site: Path) -> None:
    pages = nav()
    assert len(pages) >= 20 and {"cli.md", "config.md", "api.md"} <= set(pages.values())
    assert set(pages.values()) == {p.name for p in (ROOT / "docs").glob("*.md")}
    for title, name in pages.items():  # (the home page's title is the site's name alone)
        expected = "glassloop" if name == "index.md" else f"{html.escape(title)} - glassloop"
        assert f"<title>{expected}</title>" in page(site, name), name


def test_the_config_page_names_every_key(site: Path) -> None:
    built = page(site, "config.md")
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            if field.name == "kwargs" and section in OPEN_SECTIONS:
                continue
            assert f"<code>{section}.{field.name}</code>" in built, f"{section}.{field.name}"


def test_the_cli_page_names_every_command(site: Path) -> None:
    built = page(site, "cli.md")
    commands = [
        name for action in make_parser()._actions for name in getattr(action, "choices", None) or ()
    ]
    assert len(commands) >= 9
    for name in commands:
        assert f'id="glassloop-{name}"' in built, name


def test_the_api_page_documents_every_export(site: Path) -> None:
    """Each name of ``glassloop.__all__`` (the version string aside) has its entry, and no
    docstring's doctest reads as a quotation (docs/griffe_rest.py fences them)."""
    built = page(site, "api.md")
    names = sorted(set(glassloop.__all__) - {"__version__"})
    assert [n for n in names if f'id="glassloop.{n}"' not in built] == []
    listed = re.findall(r"^::: glassloop\.(\w+)$", (ROOT / "docs/api.md").read_text(), re.M)
    assert sorted(listed) == names, "docs/api.md lists other names than glassloop.__all__"
    assert "<blockquote>" not in built
    assert '<span class="gp">&gt;&gt;&gt; </span>' in built  # (a console block's prompt)


def test_the_docstring_adaptation_does_what_its_example_says() -> None:
    spec = importlib.util.spec_from_file_location("griffe_rest", ROOT / "docs/griffe_rest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted == 1 and result.failed == 0
