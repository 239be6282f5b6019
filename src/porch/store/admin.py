"""The operator's view of a store: a small admin protocol every backend can implement.

``porch inspect|reset|purge|check`` speak only this protocol, so they work on any
store whose class offers ``admin() -> StoreAdmin``. Keys are porch's own: a
counter key is ``rl US rule US limit US client`` and a stored response's key
``scope US idempotency-key`` (US = ``\\x1f``), whatever the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CheckReport",
    "CounterInfo",
    "PurgeReport",
    "ResponseInfo",
    "StoreAdmin",
    "split_counter_key",
]

US = "\x1f"


@dataclass(frozen=True, slots=True)
class CounterInfo:
    """One live counter: who, which rule and limit, how many, and when its window ends."""

    client: str
    rule: str
    limit: str
    count: int
    reset_in: float  # seconds until the window ends (0 once it has)


@dataclass(frozen=True, slots=True)
class ResponseInfo:
    """One stored response: its caller scope (a digest of credentials, or the client), key,
    status, and when it expires."""

    scope: str
    key: str
    status: int
    size: int
    expires_in: float  # seconds
    expires_at: float  # Unix seconds


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What a purge deleted."""

    counters: int
    responses: int


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The store's health: its schema version and every problem found (none: healthy)."""

    location: str
    schema_version: int
    expected_version: int
    problems: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        return not self.problems


class StoreAdmin(Protocol):
    """What an operator may do to a store, safely beside running servers."""

    location: str

    async def counters(self, *, client: str | None = None, most: int = 1000) -> list[CounterInfo]:
        """Live counters (of ``client`` only, if given), at most ``most``."""
        ...

    async def responses(self, *, client: str | None = None, most: int = 1000) -> list[ResponseInfo]:
        """Live stored responses (of the caller scope ``client:<client>``, if given)."""
        ...

    async def reset(self, *, client: str, rule: str | None = None) -> int:
        """Delete the counters of ``client`` (of one rule, if given); return how many."""
        ...

    async def forget(self, *, scope: str, key: str) -> int:
        """Forget the live stored response of idempotency key ``key`` in caller ``scope`` (as
        ``porch inspect`` shows them): the next request with that key runs the handler.
        Returns 1, or 0 when there was none. The response expires now (its bytes are
        reclaimed as any expired response's); a claim held on the key is left alone."""
        ...

    async def purge(self) -> PurgeReport:
        """Delete every expired counter and stored response."""
        ...

    async def check(self) -> CheckReport:
        """Schema version and integrity; never changes anything."""
        ...

    async def close(self) -> None: ...


def split_counter_key(key: str) -> tuple[str, str, str] | None:
    """``(rule, limit, client)`` of a counter key, or None if it is not one of porch's."""
    parts = key.split(US, 3)
    if len(parts) != 4 or parts[0] != "rl":
        return None
    return parts[1], parts[2], parts[3]
