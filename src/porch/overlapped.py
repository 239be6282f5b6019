"""A shard with several batches applying at once, for remote stores (``in_flight > 1``).

A remote store's round trip, not its server's work, bounds one batch in
flight; the next batch is prepared and sent while earlier ones are still out.
Each batch is prepared only once every earlier batch was prepared, and its
calls are finished (or failed) only once every earlier batch's were, so a
key's state in ``Shard.parked`` moves exactly as with one batch in flight: a
key has at most one Claim, Save or Release out at a time (its callers park on
the key meanwhile), and the store decides concurrent batches' hits exactly
under its own locks (row locks, a single-threaded server).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import StoreError

if TYPE_CHECKING:
    from .shard import Call, Shard
    from .store.base import StoreOp

__all__ = ["run_overlapped"]

logger = logging.getLogger("porch.pool")


async def run_overlapped(shard: Shard, depth: int) -> None:
    """The shard's actor: up to ``depth`` batches applying at once, replies in batch order."""
    receive = shard.mailbox.receive_batch
    loop = asyncio.get_running_loop()
    pending: deque[_Applying] = deque()
    room: list[asyncio.Future[None]] = []  # the actor, waiting for a batch to be done

    def settled(_: object) -> None:
        while pending and pending[0].done.done():
            _reply(shard, pending.popleft())
        if room:
            waiter = room.pop()
            if not waiter.done():
                waiter.set_result(None)

    def applying() -> int:
        return sum(1 for entry in pending if entry.task is not None and not entry.done.done())

    async def wait(full: Callable[[], bool]) -> None:
        while full():
            waiter = loop.create_future()
            room.append(waiter)
            await waiter

    while True:
        batch = await receive()
        if not batch:
            break
        entry = _Applying(batch, loop.create_future())
        try:
            for call in batch:
                call.prepare(shard, entry.ops)
        except Exception as exc:  # failed in its turn, like a failed transaction
            entry.done.set_exception(exc)
        else:
            if entry.ops:
                entry.started = loop.time()
                entry.task = loop.create_task(shard.store.apply(entry.ops))
                entry.task.add_done_callback(entry.applied)
            else:
                entry.done.set_result(None)
        entry.done.add_done_callback(settled)
        pending.append(entry)
        # Only batches the store is applying take room (one that needed no op does not).
        await wait(lambda: applying() >= depth)
    await wait(lambda: bool(pending))  # closing: the batches out are answered first


def _reply(shard: Shard, entry: _Applying) -> None:
    """Finish (or fail) an overlapped batch's calls, once it and every batch before are done."""
    metrics = shard.metrics
    exc = entry.done.exception()
    if exc is not None:
        error = exc if isinstance(exc, StoreError) else StoreError(repr(exc))
        if error is not exc:
            logger.error("porch shard %d: unexpected failure", shard.index, exc_info=exc)
        for call in entry.batch:
            try:
                call.fail(shard, error)
            except Exception:
                logger.exception("porch shard %d: a reply failed", shard.index)
    else:
        if metrics is not None and entry.ops:
            metrics.committed(entry.finished - entry.started, len(entry.ops))
        for call in entry.batch:
            try:
                call.finish(shard)
            except Exception:  # a bug in one reply must not strand the others
                logger.exception("porch shard %d: a reply failed", shard.index)
    if metrics is not None and metrics.multiprocess:
        metrics.shard_state(shard.index, len(shard.mailbox), shard.waiters())


class _Applying:
    """One batch of an overlapped shard: its calls, its ops, and when its apply is done."""

    __slots__ = ("batch", "done", "finished", "ops", "started", "task")

    def __init__(self, batch: list[Call], done: asyncio.Future[None]) -> None:
        self.batch = batch
        self.ops: list[StoreOp] = []
        self.done = done
        self.task: asyncio.Task[None] | None = None  # held: the loop keeps only weak references
        self.started = 0.0
        self.finished = 0.0

    def applied(self, task: asyncio.Task[None]) -> None:
        self.finished = task.get_loop().time()
        if task.cancelled():
            self.done.set_exception(StoreError("the batch was cancelled"))
        elif (exc := task.exception()) is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(None)
