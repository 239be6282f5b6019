"""Which requests the idempotency middleware honours ``Idempotency-Key`` on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._paths import normalize_method, path_matches
from ..errors import ConfigurationError
from ._capture import TOKEN

__all__ = ["IdempotencyRule", "select"]


@dataclass(frozen=True, slots=True, init=False)
class IdempotencyRule:
    """Which requests honour ``Idempotency-Key``: a path prefix and methods; ``required`` → 400
    for a selected request that has no key. ``digest_headers`` names request headers that
    change a request's meaning (an account header, say), digested with ``Content-Type``."""

    path: str
    methods: frozenset[str]
    required: bool
    digest_headers: tuple[bytes, ...]

    def __init__(
        self,
        path: str = "/",
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        digest_headers: Iterable[str] = (),
    ) -> None:
        if not path.startswith("/"):
            raise ConfigurationError(f"idempotency rule path must start with '/', got {path!r}")
        methods = frozenset(normalize_method(m) for m in methods)
        if not methods:
            raise ConfigurationError("an idempotency rule needs at least one method")
        if isinstance(digest_headers, str):
            raise ConfigurationError("digest_headers must be a sequence of header names")
        names = [b"content-type"]
        for header in digest_headers:
            name = header.strip().lower().encode("latin-1")
            if TOKEN.fullmatch(name) is None:
                raise ConfigurationError(f"digest_headers entry {header!r} is not a header name")
            if name not in names:
                names.append(name)
        object.__setattr__(self, "path", path.rstrip("/") or "/")
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "digest_headers", tuple(names))


def select(rules: Sequence[IdempotencyRule], method: str, path: str) -> IdempotencyRule | None:
    """The first rule selecting ``method`` on ``path`` (method already normalized), or None."""
    for rule in rules:
        if method in rule.methods and path_matches(rule.path, path):
            return rule
    return None
