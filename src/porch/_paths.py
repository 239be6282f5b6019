"""Which requests a rule selects: path prefixes and templates, and methods as rules compare them.

Shared by the rate-limit and idempotency rules, so both select requests alike.
"""

from __future__ import annotations

import re

from .errors import ConfigurationError

__all__ = ["compile_path", "normalize_method", "path_matches"]

# A path may hold templates: {id} (one segment; {id:int} and the like too), {rest:path}.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z_]+))?\}")
_PATH_CHARS = re.compile(r"/[!-~]*\Z")  # printable ASCII, no spaces or control bytes


def compile_path(path: str) -> re.Pattern[str] | None:
    """A prefix matcher for a path with ``{param}`` templates, or None for a plain prefix."""
    if _PATH_CHARS.match(path) is None:
        raise ConfigurationError(
            f"rule path must be printable ASCII without spaces (percent-encode the rest),"
            f" got {path!r}"
        )
    if "{" not in path and "}" not in path:
        return None
    parts: list[str] = []
    end = 0
    for match in _PLACEHOLDER.finditer(path):
        parts.append(re.escape(path[end : match.start()]))
        parts.append(".+" if match.group(2) == "path" else "[^/]+")
        end = match.end()
    rest = path[end:]
    if "{" in rest or "}" in rest or any("{" in p or "}" in p for p in parts):
        raise ConfigurationError(
            f"rule path templates are {{name}} or {{name:convertor}} (letters, digits, _),"
            f" got {path!r}"
        )
    parts.append(re.escape(rest))
    # Segment-wise like a prefix: the template itself, or anything below it.
    return re.compile("".join(parts) + r"(?:/|\Z)")


def normalize_method(method: str) -> str:
    """The method a rule compares: upper-cased (h11 passes ``post`` through as sent), and
    ``HEAD`` as ``GET`` — a HEAD runs the GET handler, so it must not slip past GET's limits."""
    method = method.upper()
    return "GET" if method == "HEAD" else method


def path_matches(prefix: str, path: str) -> bool:
    """Whether ``path`` equals ``prefix`` or lies below it (segment-wise: /api is not /apiary)."""
    return prefix == "/" or path == prefix or (path.startswith(prefix) and path[len(prefix)] == "/")
