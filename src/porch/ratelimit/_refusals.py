"""Refusals remembered: a client known to be over its limit is answered without the store.

A refused hit consumes nothing, so answering a refusal from memory keeps every
count exact. What it saves is the mailbox slot: without it, a client at 429
flooding its shard's mailbox would turn other clients of that shard away with
503. A refusal is remembered until the first of its rule's limits has more
units (a fixed window's end), and at most ``seconds`` (so an operator's reset
of a counter takes effect within that). When a memory runs out during a flood,
one request asks the store again and the others wait for its answer instead of
taking a slot each.
"""

from __future__ import annotations

import asyncio

from ..clock import Clock
from ..store.base import Hit

__all__ = ["RefusalMemory", "Remembered"]


class Remembered:
    """One client's refusal under one rule: the store's report, its times made absolute."""

    __slots__ = (
        "cost",
        "fits",
        "fulls",
        "in_flight",
        "nexts",
        "refreshing",
        "remaining",
        "retries",
        "stamps",
        "until",
    )

    def __init__(self, hit: Hit, now: float, until: float) -> None:
        self.cost = hit.cost
        self.fits = hit.fits
        self.remaining = hit.remaining
        self.stamps = hit.stamp
        self.in_flight = hit.in_flight  # a rule's concurrency caps, as they were (reported)
        # Monotonic seconds at which each limit has more units, is whole, would fit.
        self.nexts = [now + d for d in hit.next]
        self.fulls = [now + d for d in hit.full]
        self.retries = [now + d for d in hit.retry]
        self.until = until  # monotonic seconds until which the refusal is answered from here
        # Set while one request asks the store again; the others wait on it.
        self.refreshing: asyncio.Future[None] | None = None

    def release(self) -> None:
        """Wake whoever waits for this entry's refresh: it leaves the memory."""
        if self.refreshing is not None and not self.refreshing.done():
            self.refreshing.set_result(None)


class RefusalMemory:
    """A bounded map of remembered refusals, oldest evicted first (expired ones before any)."""

    __slots__ = ("_clock", "_max", "entries", "refunds", "seconds")

    def __init__(self, clock: Clock, *, seconds: float, entries: int) -> None:
        self._clock = clock
        self.seconds = float(seconds)
        self._max = entries
        # Insertion order is close to expiry order: every entry lives at most `seconds`.
        # Public for the limiter's hot path: `if not memory.entries` is a C-level check,
        # where `len(memory)` would call __len__ in Python once per request. Read it only.
        self.entries: dict[str, Remembered] = {}
        # Refunds (settles that gave units back) made through this memory's middleware: a
        # refusal decided while one was applied may predate it, and is not remembered.
        self.refunds = 0

    def __len__(self) -> int:
        return len(self.entries)

    def now(self) -> float:
        return self._clock.monotonic()

    def recall(self, key: str) -> Remembered | asyncio.Future[None] | None:
        """A live refusal to answer from; a future to wait on (another request is asking the
        store); or None: ask the store, then :meth:`remember` or :meth:`forget_expired`."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        if self._clock.monotonic() < entry.until:
            return entry
        if entry.refreshing is None:
            entry.refreshing = asyncio.get_running_loop().create_future()
            return None
        if entry.refreshing.done() or entry.refreshing.get_loop() is not asyncio.get_running_loop():
            # Its refresher finished without replacing it (a store error), or ran on an
            # event loop that has gone (the pool follows its loop): ask again.
            entry.refreshing = asyncio.get_running_loop().create_future()
            return None
        return entry.refreshing

    def remember(self, key: str, hit: Hit) -> None:
        """Remember a refused ``hit``, until the first of its limits has more units.

        Until then every limit's remaining stays as reported and its times only
        shrink with the clock, so an answer from memory is the store's own. A limit
        that is whole (``next`` 0, not a fixed window) never changes: it sets no bound.
        """
        now = self._clock.monotonic()
        changes = [d for d in hit.next if d > 0.0]
        entry = Remembered(hit, now, now + min(self.seconds, min(changes, default=self.seconds)))
        entries = self.entries
        old = entries.pop(key, None)
        if old is not None:
            old.release()
        if len(entries) >= self._max:
            self._evict(now)
        entries[key] = entry

    def forget_expired(self, key: str) -> None:
        """The store answered, not with a refusal (or failed): forget an expired memory."""
        entry = self.entries.get(key)
        # A live entry is a newer refusal another request remembered: keep it.
        if entry is not None and self._clock.monotonic() >= entry.until:
            del self.entries[key]
            entry.release()

    def forget(self, key: str) -> None:
        """Forget ``key``'s refusal, live or not: units came back (a settle refunded some,
        committed now). A refusal being decided meanwhile is not remembered (``refunds``)."""
        self.refunds += 1
        entry = self.entries.pop(key, None)
        if entry is not None:
            entry.release()

    def _evict(self, now: float) -> None:
        entries = self.entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.until > now and len(entries) < self._max:
                return
            del entries[key]
            entry.release()
