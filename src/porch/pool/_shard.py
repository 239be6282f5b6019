"""One actor of the key pool: its mailbox, its task, and the messages it takes.

A shard drains its whole mailbox, lets each message add its store operations
to the batch (``Call.prepare``), applies the batch in one store transaction
(group commit) and replies to every caller only after that transaction is
committed (``Call.finish``). Everything a shard does for a key runs on its one
task, so its volatile per-key state (``Shard.parked``) needs no locks.

A remote store (``in_flight > 1``) has several of a shard's batches applying at
once: its round trip, not its server's work, bounds one batch, so the next is
prepared and sent while earlier ones are out. Each batch is prepared only once
every earlier batch was, and its calls are answered only once every earlier
batch's were, so a key's state in ``Shard.parked`` moves exactly as with one
batch in flight: a key has at most one Claim, Save or Release out at a time
(its callers park on the key meanwhile), and the store decides concurrent
batches' hits exactly under its own locks (row locks, a single-threaded server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from .._tasks import stop_task
from ..errors import PartialStoreError, PoolClosedError, StoreError
from ._mailbox import Mailbox

if TYPE_CHECKING:
    from ..metrics import PorchMetrics
    from ..store.base import Store, StoreOp

__all__ = ["Call", "Pace", "Parked", "Shard"]

logger = logging.getLogger("porch.pool")

# How long close() waits for a shard to answer the batches it took, before cancelling it.
_CLOSE_TIMEOUT = 30.0


class Parked(Protocol):
    """Volatile state a shard keeps for a key between calls (e.g. an owner and its waiters)."""

    def close(self, exc: BaseException) -> None:
        """Fail whoever is parked here: the pool is closing."""
        ...

    def waiting(self) -> int:
        """How many callers are parked here (read for metrics only)."""
        ...


class Call:
    """A message to a shard: what it adds to the batch's transaction, and what it does after.

    The caller awaits ``future``. ``prepare`` and ``finish`` run on the shard's
    task, one message at a time, so they may touch shard state without locks.
    """

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        """Add this call's store operations to the batch (or answer from memory)."""

    def finish(self, shard: Shard) -> None:
        """Reply to the caller; runs after the batch's transaction committed."""

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        """Reply with ``exc``; runs when the transaction failed or the pool closed."""
        if not self.future.done():
            self.future.set_exception(exc)


class Pace:
    """Whether a call may skip the mailbox and commit on its caller's task (KeyPool.apply_now).

    ``spent``: one did in this loop iteration already; ``contended``: a second came in
    the same iteration (concurrent callers), so calls go through the mailboxes until
    a shard takes a batch of one again.
    """

    __slots__ = ("contended", "spent")

    def __init__(self) -> None:
        self.contended = False
        self.spent = False

    def rearm(self) -> None:
        """Called soon after a call committed at once: the next loop iteration may again."""
        self.spent = False


class Shard:
    """One actor of the pool: its mailbox, its task, and volatile per-key state."""

    __slots__ = (
        "_aside",
        "_task",
        "busy",
        "index",
        "mailbox",
        "metrics",
        "pace",
        "parked",
        "solo_save_bytes",
        "store",
    )

    def __init__(
        self,
        index: int,
        capacity: int,
        store: Store,
        metrics: PorchMetrics | None = None,
        pace: Pace | None = None,
    ) -> None:
        self.index = index
        # Its task holds a batch (from taking it until its callers are answered).
        self.busy = False
        self.pace = pace
        self.mailbox: Mailbox[Call] = Mailbox(capacity, index=index)
        self.store = store
        self.metrics = metrics
        # Volatile per-key state (idempotency owners and their parked waiters).
        # It is lost with the process, which is the point: a crash never wedges a key.
        self.parked: dict[str, Parked] = {}
        self._task: asyncio.Task[None] | None = None
        # A store's saves of bodies above this go alone (Capabilities.solo_save_bytes).
        self.solo_save_bytes = store.capabilities.solo_save_bytes
        # Work of this shard's running beside its batches (big saves): held here, since
        # the loop keeps only weak references to tasks.
        self._aside: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.busy = False
        depth = self.store.capabilities.in_flight
        run = self._run() if depth <= 1 else self._run_overlapped(depth)
        self._task = asyncio.get_running_loop().create_task(run, name=f"porch-shard-{self.index}")

    def abandon(self, exc: BaseException) -> None:
        """Close this actor without awaiting its task: its event loop has stopped."""
        for call in self.mailbox.close():
            # A future of a closed loop cannot be resolved; nobody awaits it any more.
            with contextlib.suppress(RuntimeError):
                call.fail(self, exc)
        self._task = None
        for state in list(self.parked.values()):
            with contextlib.suppress(RuntimeError):
                state.close(exc)
        self.parked.clear()

    def waiters(self) -> int:
        """Calls parked behind a running owner in this shard (read for metrics only)."""
        return sum(state.waiting() for state in self.parked.values())

    def run_aside(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` beside this shard's batches (it answers its own caller)."""
        task = asyncio.get_running_loop().create_task(work)
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)

    async def _run(self) -> None:
        receive = self.mailbox.receive_batch
        apply = self.store.apply
        # A store that calls back once a batch committed (SQLite's writer thread, or
        # an inline commit) has the callers answered from that callback: one loop
        # hop fewer per request than waking this task to answer them.
        apply_then = self.store.capabilities.apply_then
        metrics = self.metrics
        loop = asyncio.get_running_loop()
        clock = loop.time
        pace = self.pace
        while True:
            self.busy = False
            batch = await receive()
            if not batch:
                return
            self.busy = True
            if pace is not None and len(batch) == 1:
                pace.contended = False  # callers come one at a time again
            ends: list[int] = []
            try:
                ops: list[StoreOp] = []
                for call in batch:
                    call.prepare(self, ops)
                    ends.append(len(ops))
                if ops:
                    if apply_then is not None:
                        replies = _Replies(self, batch, len(ops), loop.create_future())
                        apply_then(ops, replies)
                        await replies.done  # the next batch waits: one transaction at a time
                        continue
                    if metrics is None:
                        await apply(ops)
                    else:
                        started = clock()
                        await apply(ops)
                        metrics.committed(clock() - started, len(ops))
            except Exception as exc:  # the actor must outlive any failure
                self._fail(batch, exc, ends)
                continue
            self._finish(batch)

    async def _run_overlapped(self, depth: int) -> None:
        """The actor of a remote store's shard: up to ``depth`` batches applying at once,
        replies in batch order (see the module doc)."""
        receive = self.mailbox.receive_batch
        loop = asyncio.get_running_loop()
        pending: deque[_Applying] = deque()
        room: list[asyncio.Future[None]] = []  # the actor, waiting for a batch to be done

        def batch_done(_: object) -> None:
            while pending and pending[0].done.done():
                self._reply(pending.popleft())
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
                    call.prepare(self, entry.ops)
                    entry.ends.append(len(entry.ops))
            except Exception as exc:  # failed in its turn, like a failed transaction
                entry.done.set_exception(exc)
            else:
                if entry.ops:
                    entry.started = loop.time()
                    entry.task = loop.create_task(self.store.apply(entry.ops))
                    entry.task.add_done_callback(entry.applied)
                else:
                    entry.done.set_result(None)
            entry.done.add_done_callback(batch_done)
            pending.append(entry)
            # Only batches the store is applying take room (one that needed no op does not).
            await wait(lambda: applying() >= depth)
        await wait(lambda: bool(pending))  # closing: the batches out are answered first

    def _reply(self, entry: _Applying) -> None:
        """Answer an overlapped batch's calls, once it and every batch before are done."""
        exc = entry.done.exception()
        if exc is not None:
            self._fail(entry.batch, exc, entry.ends)
            return
        if self.metrics is not None and entry.ops:
            self.metrics.committed(entry.finished - entry.started, len(entry.ops))
        self._finish(entry.batch)

    def _finish(self, batch: list[Call]) -> None:
        """Reply to every call of a committed batch."""
        for call in batch:
            try:
                call.finish(self)
            except Exception:  # a bug in one reply must not strand the others
                logger.exception("porch shard %d: a reply failed", self.index)
        self._report_state()

    def store_error(self, exc: BaseException) -> StoreError:
        """What a caller is told when applying failed: the store's StoreError as it is,
        anything else (a bug) logged with its traceback and told as a StoreError."""
        if isinstance(exc, StoreError):
            return exc
        logger.error("porch shard %d: unexpected failure", self.index, exc_info=exc)
        return StoreError(repr(exc))

    def _fail(self, batch: list[Call], exc: BaseException, ends: list[int] | None = None) -> None:
        """Fail every call of a batch whose transaction failed; of a batch a store applied
        in part (PartialStoreError, with ``ends``: where each call's ops end), only the
        calls with an op that failed: the others are answered."""
        error = self.store_error(exc)
        failed = error.failed if isinstance(error, PartialStoreError) else None
        start = 0
        for i, call in enumerate(batch):
            try:
                if failed is not None and ends is not None and i < len(ends):
                    end = ends[i]
                    if not any(j in failed for j in range(start, end)):
                        start = end
                        call.finish(self)
                        continue
                    start = end
                call.fail(self, error)
            except Exception:
                logger.exception("porch shard %d: a reply failed", self.index)
        self._report_state()

    def _report_state(self) -> None:
        metrics = self.metrics
        if metrics is not None and metrics.multiprocess:
            metrics.shard_state(self.index, len(self.mailbox), self.waiters())

    async def close(self) -> None:
        closed = PoolClosedError("the key pool closed before this call was answered")
        for call in self.mailbox.close():
            call.fail(self, closed)
        task, self._task = self._task, None
        if task is not None:
            # It answers what it took before it ends (each batch bounded by the store's
            # own deadlines); past this bound it is cancelled, never waited on forever.
            await asyncio.wait({task}, timeout=_CLOSE_TIMEOUT)
            if task.done():
                await task  # its own failure, if any, surfaces here
            else:
                await stop_task(task)
        for state in list(self.parked.values()):
            state.close(closed)
        self.parked.clear()


class _Replies:
    """Called by the store once a batch committed (or failed): answers its callers."""

    __slots__ = ("batch", "done", "ops", "shard", "started")

    def __init__(
        self, shard: Shard, batch: list[Call], ops: int, done: asyncio.Future[None]
    ) -> None:
        self.shard = shard
        self.batch = batch
        self.ops = ops
        self.done = done  # the shard's task waits on it before its next batch
        self.started = done.get_loop().time() if shard.metrics is not None else 0.0

    def __call__(self, error: BaseException | None) -> None:
        # The shard's task is woken first, so in the next iteration it sends its next
        # batch to the writer before the answered requests write their responses:
        # the writer (with fsync, the bottleneck) is not left idle meanwhile.
        if not self.done.done():  # its task may have been cancelled meanwhile
            self.done.set_result(None)
        shard = self.shard
        if error is None:
            if shard.metrics is not None:
                shard.metrics.committed(self.done.get_loop().time() - self.started, self.ops)
            shard._finish(self.batch)
        else:
            shard._fail(self.batch, error)


class _Applying:
    """One batch of an overlapped shard: its calls, its ops, and when its apply is done."""

    __slots__ = ("batch", "done", "ends", "finished", "ops", "started", "task")

    def __init__(self, batch: list[Call], done: asyncio.Future[None]) -> None:
        self.batch = batch
        self.ops: list[StoreOp] = []
        self.ends: list[int] = []  # where each call's ops end in ops
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
