"""Refusals remembered: a client known to be over its limit is answered without the store.

A refused hit consumes nothing, so answering a refusal from memory keeps every
count exact. What it saves is the mailbox slot: without it, a client at 429
flooding its shard's mailbox would turn other clients of that shard away with
503. A refusal is remembered until the first of its rule's windows ends, and at
most ``seconds`` (so an operator's reset of a counter takes effect within
that). When a memory runs out during a flood, one request asks the store again
and the others wait for its answer instead of taking a slot each.
"""

from __future__ import annotations

import asyncio

from ..clock import Clock

__all__ = ["RefusalMemory", "Remembered"]


class Remembered:
    """One client's refusal under one rule: the counts seen and when each window ends."""

    __slots__ = ("counts", "ends", "refreshing", "until")

    def __init__(self, counts: list[int], ends: list[float], until: float) -> None:
        self.counts = counts
        self.ends = ends  # monotonic seconds at which each window ends
        self.until = until  # monotonic seconds until which the refusal is answered from here
        # Set while one request asks the store again; the others wait on it.
        self.refreshing: asyncio.Future[None] | None = None

    def release(self) -> None:
        """Wake whoever waits for this entry's refresh: it leaves the memory."""
        if self.refreshing is not None and not self.refreshing.done():
            self.refreshing.set_result(None)


class RefusalMemory:
    """A bounded map of remembered refusals, oldest evicted first (expired ones before any)."""

    __slots__ = ("_clock", "_max", "entries", "seconds")

    def __init__(self, clock: Clock, *, seconds: float, entries: int) -> None:
        self._clock = clock
        self.seconds = float(seconds)
        self._max = entries
        # Insertion order is close to expiry order: every entry lives at most `seconds`.
        # Public for the limiter's hot path: `if not memory.entries` is a C-level check,
        # where `len(memory)` would call __len__ in Python once per request. Read it only.
        self.entries: dict[str, Remembered] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def now(self) -> float:
        return self._clock.monotonic()

    def recall(self, key: str) -> Remembered | asyncio.Future[None] | None:
        """A live refusal to answer from; a future to wait on (another request is asking the
        store); or None: ask the store, then :meth:`settle`."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        if self._clock.monotonic() < entry.until:
            return entry
        if entry.refreshing is None:
            entry.refreshing = asyncio.get_running_loop().create_future()
            return None
        if entry.refreshing.done() or entry.refreshing.get_loop() is not asyncio.get_running_loop():
            # Its refresher settled without replacing it (a store error), or ran on an
            # event loop that has gone (the pool follows its loop): ask again.
            entry.refreshing = asyncio.get_running_loop().create_future()
            return None
        return entry.refreshing

    def remember(self, key: str, counts: list[int], resets: list[float]) -> None:
        """Remember a refusal whose windows end ``resets`` seconds from now."""
        now = self._clock.monotonic()
        entry = Remembered(
            counts, [now + r for r in resets], now + min(self.seconds, min(resets, default=0.0))
        )
        entries = self.entries
        old = entries.pop(key, None)
        if old is not None:
            old.release()
        if len(entries) >= self._max:
            self._evict(now)
        entries[key] = entry

    def settle(self, key: str) -> None:
        """The store answered, not with a refusal (or failed): forget an expired memory."""
        entry = self.entries.get(key)
        # A live entry is a newer refusal another request remembered: keep it.
        if entry is not None and self._clock.monotonic() >= entry.until:
            del self.entries[key]
            entry.release()

    def _evict(self, now: float) -> None:
        entries = self.entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.until > now and len(entries) < self._max:
                return
            del entries[key]
            entry.release()
