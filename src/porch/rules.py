"""Rate-limit configuration: limits, and the rules that select requests for them."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigurationError

__all__ = ["Limit", "Rule", "normalize_method", "path_matches"]

# Names travel in a structured-field string (RateLimit-Policy) and in store keys.
_NAME = re.compile(r"[A-Za-z0-9_.:/+-]{1,64}\Z")


@dataclass(frozen=True, slots=True)
class Limit:
    """``amount`` requests per fixed ``window`` of seconds, starting at the key's first hit."""

    amount: int
    window: float
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.amount, bool) or not isinstance(self.amount, int) or self.amount < 1:
            raise ConfigurationError(f"limit amount must be an integer >= 1, got {self.amount!r}")
        if not (isinstance(self.window, int | float) and math.isfinite(self.window)) or (
            self.window <= 0
        ):
            raise ConfigurationError(f"limit window must be > 0 seconds, got {self.window!r}")
        if not self.name:
            object.__setattr__(self, "name", f"{self.amount}-per-{self.window:g}s")
        elif not _NAME.match(self.name):
            raise ConfigurationError(
                f"limit name must be 1-64 characters of A-Z a-z 0-9 _ . : / + -, got {self.name!r}"
            )


@dataclass(frozen=True, slots=True, init=False)
class Rule:
    """Which requests a set of limits applies to: a path prefix and, optionally, methods.

    All limits of a rule are checked together: a request passes only if every
    limit has room, and a refused request consumes none of them.
    """

    limits: tuple[Limit, ...]
    path: str
    methods: frozenset[str] | None
    name: str

    def __init__(
        self,
        limits: Iterable[Limit] | Limit,
        *,
        path: str = "/",
        methods: Iterable[str] | None = None,
        name: str = "default",
    ) -> None:
        limits = (limits,) if isinstance(limits, Limit) else tuple(limits)
        if not limits:
            raise ConfigurationError("a rule needs at least one Limit")
        if not all(isinstance(limit, Limit) for limit in limits):
            raise ConfigurationError("rule limits must be Limit instances")
        names = [limit.name for limit in limits]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"limit names within a rule must be unique, got {names}")
        if not path.startswith("/"):
            raise ConfigurationError(f"rule path must start with '/', got {path!r}")
        if not _NAME.match(name):
            raise ConfigurationError(
                f"rule name must be 1-64 characters of A-Z a-z 0-9 _ . : / + -, got {name!r}"
            )
        object.__setattr__(self, "limits", limits)
        object.__setattr__(self, "path", path.rstrip("/") or "/")
        object.__setattr__(
            self,
            "methods",
            None if methods is None else frozenset(normalize_method(m) for m in methods),
        )
        object.__setattr__(self, "name", name)

    def matches(self, method: str, path: str) -> bool:
        """Whether a request is selected: ``path`` equals the prefix or lies below it.

        ``method`` must already be normalized (:func:`normalize_method`).
        """
        if self.methods is not None and method not in self.methods:
            return False
        return path_matches(self.path, path)


def normalize_method(method: str) -> str:
    """The method a rule compares: upper-cased (h11 passes ``post`` through as sent), and
    ``HEAD`` as ``GET`` — a HEAD runs the GET handler, so it must not slip past GET's limits."""
    method = method.upper()
    return "GET" if method == "HEAD" else method


def path_matches(prefix: str, path: str) -> bool:
    """Whether ``path`` equals ``prefix`` or lies below it (segment-wise: /api is not /apiary)."""
    return prefix == "/" or path == prefix or (path.startswith(prefix) and path[len(prefix)] == "/")
