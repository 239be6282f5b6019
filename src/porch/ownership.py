"""Idempotency on the key pool: the four outcomes, decided by the shard that owns the key.

A keyed request sends :class:`Acquire` and gets one of: the stored response
(digest matches), a mismatch (digest differs), or ownership (nothing stored,
nobody running). If an owner is running it gets nothing yet: it stays parked
in the shard's volatile state until the owner reports with :class:`Complete`.
That state dies with the process, so a crash never wedges a key.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from .errors import StoreError
from .pool import Call, Shard
from .store.base import Lookup, Save, StoredResponse, StoreOp

__all__ = ["OWNER", "Acquire", "Complete", "Mismatch", "Outcome"]


class _Owner:
    """The caller owns the key: run the handler and report with Complete."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OWNER"


OWNER = _Owner()


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key holds a response for a different request (digest differs)."""

    stored_digest: bytes


Outcome = StoredResponse | Mismatch | _Owner


def _answer(stored: StoredResponse, digest: bytes) -> StoredResponse | Mismatch:
    return stored if stored.digest == digest else Mismatch(stored.digest)


class _InFlight:
    """A key with a running owner (or a lookup under way), and the callers parked behind it."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: deque[Acquire] = deque()

    def close(self, exc: BaseException) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(exc)

    def promote(self) -> bool:
        """Hand ownership to the first waiter still waiting; False if there is none."""
        while self.waiters:
            waiter = self.waiters.popleft()
            # A waiter past its deadline (or whose client left) cancelled its future.
            if not waiter.future.done():
                waiter.future.set_result(OWNER)
                return True
        return False

    def resolve(self, stored: StoredResponse) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(_answer(stored, waiter.digest))


class Acquire(Call):
    """Ask for a key: stored response, mismatch, ownership, or park until the owner reports."""

    __slots__ = ("digest", "key", "lookup")

    def __init__(self, future: asyncio.Future[Outcome], key: str, digest: bytes) -> None:
        super().__init__(future)
        self.key = key
        self.digest = digest
        self.lookup: Lookup | None = None

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        state: _InFlight | None = shard.parked.get(self.key)
        if state is not None:
            state.waiters.append(self)  # parked: answered when the owner reports
            return
        shard.parked[self.key] = _InFlight()
        self.lookup = Lookup(self.key)
        ops.append(self.lookup)

    def finish(self, shard: Shard) -> None:
        if self.lookup is None:
            return
        stored = self.lookup.result
        if stored is None:
            if not self.future.done():
                self.future.set_result(OWNER)
                return
            # The caller left while we looked: the next waiter (if any) owns the key.
            state: _InFlight = shard.parked[self.key]
            if not state.promote():
                del shard.parked[self.key]
            return
        if not self.future.done():
            self.future.set_result(_answer(stored, self.digest))
        shard.parked.pop(self.key).resolve(stored)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None and self.lookup is not None:
            # The lookup failed: nobody owns the key, and those parked behind it fail too.
            state: _InFlight | None = shard.parked.pop(self.key, None)
            if state is not None:
                state.close(exc)


class Complete(Call):
    """The owner's report: a response to store and hand to waiters, or ``None`` (not stored)."""

    __slots__ = ("key", "save")

    def __init__(
        self,
        future: asyncio.Future[None],
        key: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> None:
        super().__init__(future)
        self.key = key
        self.save = None if response is None else Save(key, response, ttl)

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        if self.save is not None:
            ops.append(self.save)

    def finish(self, shard: Shard) -> None:
        state: _InFlight | None = shard.parked.get(self.key)
        if state is not None:
            if self.save is not None:
                del shard.parked[self.key]
                state.resolve(self.save.response)  # only now: it is committed
            elif not state.promote():
                del shard.parked[self.key]
        if not self.future.done():
            self.future.set_result(None)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None:
            # Not stored, so not replayable: waiters get the store failure, not a response
            # that no retry could ever be shown again.
            state: _InFlight | None = shard.parked.pop(self.key, None)
            if state is not None:
                state.close(exc if isinstance(exc, StoreError) else StoreError(str(exc)))
