"""The API reference's one adaptation (mkdocs.yml loads it into mkdocstrings): glassloop's
docstrings are written for ``help()`` and doctest, in reST; the site renders Markdown. A
doctest example (``>>>`` to the next blank line) becomes a Python console block and a
:role:`reference` a code span, so neither reads as a quotation or a link; the rest is left as
written (``code`` is the same in both)."""

from __future__ import annotations

import re
from typing import Any

import griffe


class RestDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)


def markdown(text: str) -> str:
    r"""``text`` with its doctest examples fenced and its roles as code spans.

    >>> markdown("Run it::\n\n>>> 1 + 1\n2\n\nSee :func:`~glassloop.rng.seed`.").splitlines()
    ['Run it:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'See `seed`.']
    """
    lines: list[str] = []
    fence = None  # the open example's indentation
    for line in text.splitlines():
        if fence is None and line.lstrip().startswith(">>>"):
            fence = line[: len(line) - len(line.lstrip())]
            lines.append(fence + "```pycon")
        elif fence is not None and not line.strip():
            lines.append(fence + "```")
            fence = None
        if fence is None:
            line = re.sub(r":\w+:`~(?:[\w.]*\.)?(\w+)`", r"`\1`", line)  # (~: the last name)
            line = re.sub(r":\w+:`([^`]+)`", r"`\1`", line)
            line = re.sub(r"(\S)::$", r"\1:", line)  # (reST's literal block: indented here too)
        lines.append(line)
    if fence is not None:
        lines.append(fence + "```")
    return "\n".join(lines)
