"""A bounded single-consumer mailbox, in the shape of anyio's memory object stream.

``send_nowait`` never waits: a full mailbox raises :class:`SaturatedError` at
once, which is what lets the middleware answer 503 instead of queueing without
bound. The one consumer (a shard actor) takes everything queued in one call, so
a drain becomes one store transaction.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import ConfigurationError, PoolClosedError, SaturatedError

__all__ = ["Mailbox", "MailboxStatistics"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MailboxStatistics:
    """A snapshot of one mailbox."""

    capacity: int
    queued: int
    sent: int
    saturations: int
    batches: int
    largest_batch: int
    closed: bool


class Mailbox(Generic[T]):
    """Bounded FIFO with a non-blocking send and a batch receive."""

    __slots__ = (
        "_batches",
        "_capacity",
        "_closed",
        "_index",
        "_items",
        "_largest",
        "_saturations",
        "_sent",
        "_waiter",
    )

    def __init__(self, capacity: int, *, index: int = 0) -> None:
        if capacity < 1:
            raise ConfigurationError(f"mailbox capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._index = index
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._sent = 0
        self._saturations = 0
        self._batches = 0
        self._largest = 0

    def send_nowait(self, item: T, *, force: bool = False) -> None:
        """Queue ``item``; raise SaturatedError when full, PoolClosedError when closed.

        ``force`` queues past the capacity (for messages that must not be dropped).
        """
        if self._closed:
            raise PoolClosedError("the key pool is closed")
        if len(self._items) >= self._capacity and not force:
            self._saturations += 1
            raise SaturatedError(self._index, self._capacity)
        self._items.append(item)
        self._sent += 1
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def bypassed(self) -> None:
        """Count a call its shard answered without queueing it (KeyPool.apply_now)."""
        self._sent += 1

    async def receive_batch(self) -> list[T]:
        """Wait for at least one item and take every queued item; ``[]`` once closed and empty."""
        while not self._items:
            if self._closed:
                return []
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            await waiter
        batch = list(self._items)
        self._items.clear()
        self._batches += 1
        if len(batch) > self._largest:
            self._largest = len(batch)
        return batch

    def close(self) -> list[T]:
        """Refuse further sends, wake the consumer, and hand back what was still queued."""
        self._closed = True
        left = list(self._items)
        self._items.clear()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return left

    def __len__(self) -> int:
        """Items queued now."""
        return len(self._items)

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            capacity=self._capacity,
            queued=len(self._items),
            sent=self._sent,
            saturations=self._saturations,
            batches=self._batches,
            largest_batch=self._largest,
            closed=self._closed,
        )
