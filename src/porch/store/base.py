"""The store seam: the operations a backend applies, and the protocol it implements.

The seam is as narrow as the engines need: ``apply`` takes a batch of
operations and applies all of them in one transaction, returning only once it
is durable. Each operation carries its own inputs and receives its results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["Durability", "Hit", "Store", "StoreOp", "StoreStatistics"]

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


StoreOp = Hit


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a store has done since it was opened."""

    transactions: int
    operations: int
    failures: int


class Store(Protocol):
    """A durable backend for counters and stored responses."""

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
