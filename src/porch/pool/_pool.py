"""The sharded key pool: N shard actors, one bounded mailbox each.

A key always reaches shard ``crc32(key) % N``, so everything about one key is
serialized through one actor without locks. A shard drains its whole mailbox,
applies the batch in one store transaction (group commit) and replies to every
caller only after that transaction is committed (see :mod:`porch.pool._shard`).

The pool follows the event loop it is used on. Its actors are tasks of one
loop; when it is used from another loop while that one has stopped (each
request of Starlette's ``TestClient`` without ``with`` runs on a loop of its
own, so does each test of pytest-asyncio or anyio), ``start()`` abandons the
old actors, closes the store and opens it again, and starts fresh actors on
the current loop. Nothing live is abandoned: a pool whose loop is still
running elsewhere refuses the other loop (PoolClosedError) instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigurationError, PoolClosedError, StoreError
from ._mailbox import MailboxStatistics
from ._namespaces import Namespaces
from ._shard import Call, Pace, Shard

if TYPE_CHECKING:
    from ..metrics import PorchMetrics
    from ..store.base import Store, StoreOp, StoreStatistics

__all__ = ["Call", "KeyPool", "PoolStatistics", "Shard"]

logger = logging.getLogger("porch.pool")

# After a store failed to open, calls fail fast for this long before it is retried.
_REOPEN_AFTER = 1.0
# Closing the store of a stopped loop is bounded: a restart must never hang a request.
_CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of the pool and its store."""

    shards: tuple[MailboxStatistics, ...]
    store: StoreStatistics

    @property
    def queued(self) -> int:
        return sum(s.queued for s in self.shards)

    @property
    def calls(self) -> int:
        return sum(s.sent for s in self.shards)

    @property
    def saturations(self) -> int:
        return sum(s.saturations for s in self.shards)


class KeyPool:
    """N shard actors over one store, on the event loop that uses it (see the module doc).

    ``size`` is N; by default the store's (``Capabilities.shards``: SQLite 1, its one
    writer thread commits all shards' batches together anyway; PostgreSQL and Redis 4,
    whose shards' batches go out side by side). ``mailbox`` is
    each shard's capacity in queued operations: past it, calls are refused at once.
    """

    __slots__ = (
        "_failed",
        "_hooks",
        "_keeper",
        "_lock",
        "_loop",
        "_now",
        "_pace",
        "_pid",
        "_shards",
        "_size",
        "_started",
        "metrics",
        "namespaces",
        "store",
    )

    def __init__(
        self,
        store: Store,
        *,
        size: int | None = None,
        mailbox: int = 1024,
        metrics: PorchMetrics | None = None,
    ) -> None:
        capabilities = store.capabilities
        if size is None:
            size = capabilities.shards
        if size < 1:
            raise ConfigurationError(f"pool size must be >= 1, got {size}")
        if mailbox < 1:
            raise ConfigurationError(f"mailbox capacity must be >= 1, got {mailbox}")
        self.store = store
        # Counter namespaces the limiters on this pool have claimed (see porch.namespaces).
        self.namespaces = Namespaces()
        # The middlewares using this pool report into the same metrics.
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)
        self._size = size
        # A store that can commit a small batch on the event loop, cheaply and at once
        # (SQLite with durability="process"): see apply_now. Never beside overlapped
        # batches, which a shard's busy flag does not cover.
        self._now = capabilities.apply_now if capabilities.in_flight <= 1 else None
        self._pace = Pace()
        self._shards = tuple(Shard(i, mailbox, store, metrics, self._pace) for i in range(size))
        self._started = False
        # The task that closes the pool when its loop is torn down with the pool open.
        self._keeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the actors run on
        self._pid = 0  # the process they run in
        # One start-up lock per loop: an asyncio.Lock binds to the loop it first waits on.
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._failed: tuple[float, StoreError] | None = None
        # What runs as the pool closes, while its actors still take calls (before_close).
        self._hooks: list[Callable[[], Awaitable[None]]] = []

    @property
    def size(self) -> int:
        return self._size

    @property
    def started(self) -> bool:
        """Whether the actors run — on the running event loop, when asked from one."""
        if not self._started:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # asked from outside any loop
            return True

    def shard_index(self, key: str) -> int:
        """The shard that owns ``key``: a stable hash, the same in every process and run."""
        return zlib.crc32(key.encode("utf-8", "surrogatepass")) % self._size

    async def start(self) -> None:
        """Open the store and start the actors on the running loop; a second call does nothing.

        Called from another loop than the actors' (which has stopped), it moves
        the pool to this loop; if that loop is still running, it raises
        PoolClosedError: one pool serves one running loop at a time.
        """
        loop = asyncio.get_running_loop()
        if self._started and self._loop is loop:
            return
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            if self._started and self._loop is loop:
                return
            if self._started:
                await self._leave_stopped_loop()
            if self._failed is not None and loop.time() - self._failed[0] < _REOPEN_AFTER:
                # A broken store is retried at most once a second, not once per request.
                raise self._failed[1]
            try:
                await self.store.open()
            except StoreError as exc:
                self._failed = (loop.time(), exc)
                raise
            self._failed = None
            if any(s.mailbox.statistics().closed for s in self._shards):
                # Started again after close(): fresh actors (and statistics).
                capacity = self._shards[0].mailbox.statistics().capacity
                self._shards = tuple(
                    Shard(i, capacity, self.store, self.metrics, self._pace)
                    for i in range(self._size)
                )
            # (A stopped loop may have left "spent" set: its rearm never ran.)
            self._pace.spent = self._pace.contended = False
            for shard in self._shards:
                shard.start()
            self._loop = loop
            self._pid = os.getpid()
            self._started = True
            self._keeper = loop.create_task(self._close_with_loop(), name="porch-pool-keeper")

    async def _leave_stopped_loop(self) -> None:
        """The actors' loop is not the running one: abandon them, if that loop has stopped."""
        old = self._loop
        # A loop copied into a forked child still says it runs; it never will there.
        if old is not None and old.is_running() and self._pid == os.getpid():
            raise PoolClosedError(
                "the key pool runs on another event loop that is still running;"
                " one pool serves one running loop at a time (make a pool per loop)"
            )
        logger.debug("porch: the key pool's event loop stopped; restarting on this one")
        self._started = False
        self._keeper = None  # a task of the stopped loop
        closed = PoolClosedError("the key pool's event loop stopped before this call was answered")
        for shard in self._shards:
            shard.abandon(closed)
        # The store too: its claims belonged to callers of the stopped loop, and its
        # loop-bound parts (futures, wake-ups, connections) go with them.
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self.store.close()
        except Exception as exc:  # the store is opened again next, which may still work
            logger.warning("porch: closing the store of a stopped event loop failed: %r", exc)

    async def _close_with_loop(self) -> None:
        """Wait until this loop is torn down, then close the pool if it is still open.

        A server without the ASGI lifespan (Django's ASGI app, ``--lifespan off``) opens
        the pool at the first request and never says it stops; asyncio.run (uvicorn,
        gunicorn's workers, hypercorn, test runners) cancels every task left on the loop
        as it ends, this one too, and the store is closed then — not abandoned (SQLite:
        its WAL checkpointed and removed, no thread left). close() cancels it first.
        """
        try:
            await asyncio.get_running_loop().create_future()  # never set
        except asyncio.CancelledError:
            if self._keeper is not asyncio.current_task():
                return  # close() ran (or the pool moved): nothing left to do here
            self._keeper = None
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # this task's cleanup may await (bounded below)
            await self._close_at_teardown()

    async def _close_at_teardown(self) -> None:
        # Deadlines with asyncio.timeout, never wait_for (see porch._tasks).
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self.close()
        except (Exception, asyncio.CancelledError) as exc:
            # A shard task cancelled with the loop's other tasks ends close() early: its
            # callers are failed already; the store must still be closed.
            logger.debug("porch: closing the pool as its loop ends: %r", exc)
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await self.store.close()
            except Exception as exc:
                logger.warning("porch: closing the store as its event loop ended failed: %r", exc)

    def before_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await ``hook`` when the pool closes on its running loop, before its actors stop:
        a middleware returning what it holds (the unspent units of sliced limits)."""
        self._hooks.append(hook)

    async def close(self) -> None:
        """Refuse new calls, fail queued and parked callers (PoolClosedError), close the store."""
        if not self._started:
            return
        if self._hooks and self._loop is asyncio.get_running_loop():
            for hook in self._hooks:
                # Bounded, and never in the way of the close: what a hook could not hand
                # back is what a host killed outright would leave (a stated bound).
                try:
                    async with asyncio.timeout(_CLOSE_TIMEOUT):
                        await hook()
                except Exception as exc:
                    logger.warning("porch: a hook run as the pool closed failed: %r", exc)
            if not self._started:
                return  # (closed meanwhile, by another close())
        self._started = False
        keeper, self._keeper = self._keeper, None
        running = asyncio.get_running_loop()
        # (A stopped loop's task cannot be woken: it is dropped with its loop.)
        if (
            keeper is not None
            and keeper is not asyncio.current_task()
            and keeper.get_loop() is running
        ):
            keeper.cancel()
        if self._loop is running:
            for shard in self._shards:
                await shard.close()
        else:  # the actors' loop has stopped (or runs elsewhere): their tasks cannot be awaited
            closed = PoolClosedError("the key pool closed before this call was answered")
            for shard in self._shards:
                shard.abandon(closed)
        await self.store.close()

    def submit(
        self, key: str, call: Call, *, must_deliver: bool = False, shard: int | None = None
    ) -> int:
        """Queue ``call`` on the shard owning ``key``; raises SaturatedError when it is full.
        Returns that shard's index (``shard_index(key)``).

        ``must_deliver`` skips the capacity check, for reports that release state
        (an owner's result): they are bounded by the calls already admitted, and
        dropping one would strand the callers parked behind it. ``shard``: the index
        an earlier submit for the same key returned, so the key is not hashed again
        (an idempotency owner's report follows its acquire).
        """
        if not self._started:
            raise PoolClosedError("the key pool is not running")
        if self._loop is not asyncio.get_running_loop():
            # The actors would never see it: never a hang, a clear error (start() moves the pool).
            raise PoolClosedError("the key pool runs on another event loop; await start() first")
        if shard is None:
            shard = zlib.crc32(key.encode("utf-8", "surrogatepass")) % self._size
        self._shards[shard].mailbox.send_nowait(call, force=must_deliver)
        return shard

    def apply_now(self, key: str, op: StoreOp) -> bool:
        """Commit ``op`` on the calling task, now, if nothing else is in flight: True once
        it committed (its answer is in ``op``); False if nothing was applied (submit it).

        With no other caller about, a request's wait for its decision is mostly hops:
        the mailbox waking the shard's task, the store's flush, the reply waking the
        request. Here the store commits on the event loop instead (only a store that
        does that cheaply: SQLite with ``durability="process"``, a ``write()`` into
        the page cache, never an fsync; only hits; never while its writer is busy).
        The shard is idle, its mailbox empty and the call runs to its COMMIT without
        yielding, so nothing else of the shard can be in flight meanwhile: the same
        one-batch-at-a-time the shard's task keeps. At most one call per loop
        iteration: a second one in the same iteration means concurrent callers, which
        group commits serve better, so they take the mailboxes until a shard takes a
        batch of one again.
        """
        now = self._now
        pace = self._pace
        if now is None or pace.contended or not self._started:
            return False
        if pace.spent:
            pace.contended = True
            return False
        loop = self._loop
        if loop is not asyncio.get_running_loop():
            return False
        shard = self._shards[zlib.crc32(key.encode("utf-8", "surrogatepass")) % self._size]
        if shard.busy or len(shard.mailbox):
            return False
        metrics = self.metrics
        started = loop.time() if metrics is not None else 0.0
        if not now((op,)):
            return False
        pace.spent = True
        loop.call_soon(pace.rearm)
        shard.mailbox.bypassed()
        if metrics is not None:
            metrics.committed(loop.time() - started, 1)
        return True

    def shard_load(self) -> list[tuple[int, int]]:
        """Per shard: operations queued in its mailbox, and calls parked behind an owner."""
        return [(len(s.mailbox), s.waiters()) for s in self._shards]

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            shards=tuple(s.mailbox.statistics() for s in self._shards),
            store=self.store.statistics(),
        )

    async def __aenter__(self) -> KeyPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
