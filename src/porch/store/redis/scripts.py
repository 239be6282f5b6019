"""The server-side scripts: read once from the package, run by SHA, reloaded on NOSCRIPT."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

__all__ = ["Script", "library", "load_scripts"]


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: its source (for SCRIPT LOAD) and its SHA1 (for EVALSHA)."""

    name: str
    source: bytes
    sha: str


# A script's line ``--#include _name.lua`` is replaced by that file (a Lua script
# runs alone: code several scripts share is included into each).
_INCLUDE = b"--#include "


def load_scripts() -> dict[str, Script]:
    """Every ``*.lua`` file shipped in this package, by name (``hit``, ``claim``...); the
    files named ``_*.lua`` are only included into others."""
    files = {
        entry.name: entry.read_bytes()
        for entry in resources.files(__package__).iterdir()
        if entry.name.endswith(".lua")
    }
    found: dict[str, Script] = {}
    for filename, text in files.items():
        if filename.startswith("_"):
            continue
        source = b"".join(
            files[line[len(_INCLUDE) :].strip().decode()] if line.startswith(_INCLUDE) else line
            for line in text.splitlines(keepends=True)
        )
        name = filename.removesuffix(".lua")
        found[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    source = slot_hits(found["counters"].source, files["_slots.lua"])
    found["slot_hits"] = Script("slot_hits", source, hashlib.sha1(source).hexdigest())
    return found


# Where _slots.lua's two steps go into counters.lua (each exactly once): its limits are
# the KEYS before the slot keys, a hit's count is capped before its limits are read, and
# its slots are taken once its limits let it through, before the reply (none by a probe).
_SLOT_STEPS = (
    (b"local L = #KEYS\n", b"local L = #KEYS - SLOTS\n"),
    (b"local k = m\n", b"local k = admit(m)\n"),
    (b"\nreturn out\n", b"\nadmitted(k, out, probe)\nreturn out\n"),
)


def slot_hits(counters: bytes, slots: bytes) -> bytes:
    """The script deciding hits that take concurrency slots: counters.lua with the slots'
    steps (_slots.lua) put around its decision, so the rule is written once."""
    for old, new in _SLOT_STEPS:
        if counters.count(old) != 1:
            raise RuntimeError(f"counters.lua has changed: {old!r} is not in it once")
        counters = counters.replace(old, new)
    return slots + counters


def library(filename: str) -> bytes:
    """A ``_*.lua`` file's code, to include into a script built elsewhere (the admin's)."""
    return resources.files(__package__).joinpath(filename).read_bytes()
