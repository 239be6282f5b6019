"""A griffe extension for the API reference: Sphinx roles in porch's docstrings
(``:class:`~porch.Store```, ``:func:`...```, ``:mod:`...```) shown as code, as a reader of
the source sees them (mkdocs renders Markdown, where a role would show as text)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


class Roles(griffe.Extension):
    """Rewrite Sphinx roles to code spans in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and ":" in docstring.value:
            docstring.value = _ROLE.sub(_code, docstring.value)


def _code(match: re.Match[str]) -> str:
    target = match.group(1)
    # "~porch.x.Store" shows "Store", as Sphinx would.
    shown = target.rsplit(".", 1)[-1] if match.group(0).count("~") else target
    return f"`{shown}`"
