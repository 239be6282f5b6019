"""The server-side scripts: read once from the package, run by SHA, reloaded on NOSCRIPT."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

__all__ = ["Script", "load_scripts"]


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: its source (for SCRIPT LOAD) and its SHA1 (for EVALSHA)."""

    name: str
    source: bytes
    sha: str


def load_scripts() -> dict[str, Script]:
    """Every ``*.lua`` file shipped in this package, by name (``hit``, ``claim``...)."""
    found: dict[str, Script] = {}
    for entry in resources.files(__package__).iterdir():
        if entry.name.endswith(".lua"):
            source = entry.read_bytes()
            name = entry.name.removesuffix(".lua")
            found[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    return found
