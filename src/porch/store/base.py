"""The store seam: the operations a backend applies, and the protocol it implements.

The seam is as narrow as the engines need: ``apply`` takes a batch of
operations and applies all of them in one transaction, returning only once it
is durable. Each operation carries its own inputs and receives its results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from ..locks import KeyLocks

__all__ = [
    "Durability",
    "Hit",
    "Lookup",
    "Save",
    "Store",
    "StoreOp",
    "StoreStatistics",
    "StoredResponse",
]

Durability = Literal["process", "power"]
"""``"process"``: a commit survives the process being killed (``kill -9``), not a power loss.
``"power"``: every group commit is synced to disk and survives a power loss."""


class Hit:
    """Count one request against one or more fixed-window limits, all or nothing.

    Inputs: one counter key, amount and window (seconds) per limit. Results,
    filled by the store: whether the request is allowed (a refused hit consumes
    nothing), the count of each window after this hit, and the seconds until
    each window ends; ``wall`` is the wall time the decision was taken at.
    """

    __slots__ = ("allowed", "amounts", "counts", "keys", "resets", "wall", "windows")

    def __init__(
        self, keys: Sequence[str], amounts: Sequence[int], windows: Sequence[float]
    ) -> None:
        self.keys = keys
        self.amounts = amounts
        self.windows = windows
        self.allowed = False
        self.counts: list[int] = []
        self.resets: list[float] = []
        self.wall = 0.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response kept for replay: what a duplicate request receives, byte for byte."""

    digest: bytes
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class Lookup:
    """Find the stored response for a scoped idempotency key (``None``: none, or expired).

    An expired row found here is deleted in the same transaction (pruned when touched).
    """

    __slots__ = ("key", "result")

    def __init__(self, key: str) -> None:
        self.key = key
        self.result: StoredResponse | None = None


class Save:
    """Store ``response`` under a scoped idempotency key for ``ttl`` seconds."""

    __slots__ = ("key", "response", "ttl")

    def __init__(self, key: str, response: StoredResponse, ttl: float) -> None:
        self.key = key
        self.response = response
        self.ttl = ttl


StoreOp = Hit | Lookup | Save


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a store has done since it was opened."""

    transactions: int
    operations: int
    failures: int


class Store(Protocol):
    """A durable backend for counters and stored responses.

    ``locks`` gives idempotency ownership across processes sharing the store
    (None: ownership is per process).
    """

    locks: KeyLocks | None

    async def open(self) -> None:
        """Connect, create or migrate the schema; idempotent."""
        ...

    async def close(self) -> None:
        """Finish queued work and release the backend."""
        ...

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        """Apply ``ops`` in one transaction; return once it is committed, or raise StoreError."""
        ...

    def statistics(self) -> StoreStatistics: ...
