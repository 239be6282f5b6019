"""Idempotency on the key pool: the four outcomes, decided by the shard that owns the key.

A keyed request sends :class:`Acquire` and gets one of: the stored response
(digest matches), a mismatch (digest differs), or ownership (nothing stored,
nobody running). If an owner is running it gets nothing yet: it stays parked
in the shard's volatile state until the owner reports with :class:`Complete`.
That state dies with the process, so a crash never wedges a key.

Across processes sharing a store, the in-process owner also holds the key's
lock in the store's :class:`~porch.locks.KeyLocks` from before its lookup until
its response is committed. When another process holds it, a thread waits for
the lock (no polling) and the key is looked up again once it is ours.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

from .errors import PoolClosedError, StoreError
from .locks import KeyLocks
from .pool import Call, Shard
from .store.base import Lookup, Save, StoredResponse, StoreOp

__all__ = ["OWNER", "Acquire", "Complete", "Mismatch", "Outcome"]

logger = logging.getLogger("porch.idempotency")


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
    """A key being decided or run in this process: its waiters and its cross-process lock."""

    __slots__ = ("key", "locked", "locks", "waiters")

    def __init__(self, key: str, locks: KeyLocks | None) -> None:
        self.key = key
        self.waiters: deque[Acquire] = deque()
        self.locks = locks
        self.locked = False

    def release(self) -> None:
        if self.locked and self.locks is not None:
            self.locked = False
            try:
                self.locks.release(self.key)
            except OSError as exc:  # the lock goes with the file at exit anyway
                logger.error("porch: releasing the lock of an idempotency key failed: %s", exc)

    def close(self, exc: BaseException) -> None:
        self.release()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(exc)

    def live(self) -> bool:
        return any(not w.future.done() for w in self.waiters)

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


def _state(shard: Shard, key: str) -> _InFlight | None:
    # The shard keeps only this module's state in ``parked``.
    return cast("_InFlight | None", shard.parked.get(key))


def _drop(shard: Shard, key: str) -> _InFlight | None:
    """Forget a key's in-flight state and release its cross-process lock."""
    state = cast("_InFlight | None", shard.parked.pop(key, None))
    if state is not None:
        state.release()
    return state


def _settle(shard: Shard, key: str, stored: StoredResponse | None) -> None:
    """After a lookup under the key's lock: answer everyone, or hand ownership to one."""
    state = cast(_InFlight, shard.parked[key])
    if stored is not None:
        _drop(shard, key)
        state.resolve(stored)
    elif not state.promote():
        _drop(shard, key)


class _LookingUp(Call):
    """A call that may look its key up under the key's lock, then settles the key."""

    __slots__ = ("key", "lookup")

    def __init__(self, future: asyncio.Future[Any], key: str) -> None:
        super().__init__(future)
        self.key = key
        self.lookup: Lookup | None = None

    def _look(self, ops: list[StoreOp]) -> None:
        self.lookup = Lookup(self.key)
        ops.append(self.lookup)

    def finish(self, shard: Shard) -> None:
        if self.lookup is not None:
            _settle(shard, self.key, self.lookup.result)


class Acquire(_LookingUp):
    """Ask for a key: stored response, mismatch, ownership, or park until the owner reports.

    A call that has to wait (behind an owner, or for another process's lock)
    fails with TimeoutError after ``timeout`` seconds.
    """

    __slots__ = ("digest", "timeout")

    def __init__(
        self, future: asyncio.Future[Outcome], key: str, digest: bytes, timeout: float
    ) -> None:
        super().__init__(future, key)
        self.digest = digest
        self.timeout = timeout

    def _park(self, state: _InFlight) -> None:
        state.waiters.append(self)  # answered when the owner reports
        # Only a waiting call pays for a timer: the common first caller never waits.
        deadline = self.future.get_loop().call_later(self.timeout, _expire, self.future)
        self.future.add_done_callback(lambda _: deadline.cancel())

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        state = _state(shard, self.key)
        if state is not None:
            self._park(state)
            return
        # The first caller is the first waiter: the lookup's outcome answers it
        # like everyone parked behind it meanwhile (see _settle).
        locks = shard.store.locks
        state = _InFlight(self.key, locks)
        shard.parked[self.key] = state
        if locks is not None:
            try:
                state.locked = locks.try_acquire(self.key)
            except OSError as exc:
                state.waiters.append(self)
                _drop(shard, self.key)
                state.close(StoreError(f"cannot lock the key: {exc}"))
                return
            if not state.locked:
                # Another process owns the key: wait for its lock, then look again.
                self._park(state)
                _wait_for_lock(shard, self.key, locks)
                return
        state.waiters.append(self)
        self._look(ops)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None and self.lookup is not None:
            # The lookup failed: nobody owns the key, and those parked behind it fail too.
            state = _drop(shard, self.key)
            if state is not None:
                state.close(exc)


class _Relook(_LookingUp):
    """The key's lock came free (its owner in another process finished or died): look again."""

    __slots__ = ("error",)

    def __init__(self, future: asyncio.Future[None], key: str, error: BaseException | None) -> None:
        super().__init__(future, key)
        self.error = error  # None: the lock is ours now

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        state = _state(shard, self.key)
        if state is None or self.error is not None:
            if state is not None:
                _drop(shard, self.key)
                state.close(StoreError(f"cannot lock the key: {self.error}"))
            elif self.error is None and shard.store.locks is not None:
                shard.store.locks.release(self.key)
            return
        state.locked = True
        if not state.live():  # everyone waiting gave up meanwhile
            _drop(shard, self.key)
            return
        self._look(ops)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        # Nobody awaits a relook: its failure goes to the waiters it was for.
        state = _drop(shard, self.key) if shard is not None else None
        if state is not None:
            state.locked = self.error is None  # ours if the thread got it: close() frees it
            state.close(exc)
        elif self.error is None and shard is not None and shard.store.locks is not None:
            shard.store.locks.release(self.key)


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _wait_for_lock(shard: Shard, key: str, locks: KeyLocks) -> None:
    """Block a daemon thread (not the loop, not the CPU) until the key's lock is ours."""
    loop = asyncio.get_running_loop()

    def deliver(error: BaseException | None) -> None:
        relook = _Relook(loop.create_future(), key, error)
        try:
            shard.mailbox.send_nowait(relook, force=True)
        except PoolClosedError:
            if error is None:
                locks.release(key)

    def wait() -> None:
        error: OSError | None = None
        try:
            locks.acquire(key)
        except OSError as exc:
            logger.error("porch: waiting for the lock of an idempotency key failed: %s", exc)
            error = exc
        try:
            loop.call_soon_threadsafe(deliver, error)
        except RuntimeError:  # the loop is closed: nobody is left to own the key
            if error is None:
                locks.release(key)

    threading.Thread(target=wait, name="porch-key-lock", daemon=True).start()


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
        # Committed (or nothing to commit): only now may the lock go and waiters be told.
        if self.key in shard.parked:
            _settle(shard, self.key, None if self.save is None else self.save.response)
        if not self.future.done():
            self.future.set_result(None)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None:
            # Not stored, so not replayable: waiters get the store failure, not a response
            # that no retry could ever be shown again.
            state = _drop(shard, self.key)
            if state is not None:
                state.close(exc if isinstance(exc, StoreError) else StoreError(str(exc)))
