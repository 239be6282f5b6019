"""The embedded default store: one SQLite file in WAL mode, written by one thread
(bodies above 64 KiB in a side file with a writer thread of its own, see blobs.py).

Every operation goes to a dedicated writer thread (the event loop never blocks
on SQLite). The thread takes whatever batches are queued — from any shard —
and applies them in one ``BEGIN IMMEDIATE`` transaction: group commit. The
write lock taken by ``BEGIN IMMEDIATE`` is also what serializes several
processes sharing the file, so a decision is always read-decide-write under
the lock, never a read-modify-write from a request task.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
import sqlite3
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._eventlog import EventLog
from ...clock import Clock, SystemClock
from ...errors import ConfigurationError, StoreError
from ..base import (
    ALGORITHMS,
    PART_GRACE,
    Capabilities,
    Claims,
    Durability,
    Hit,
    Settle,
    StoreOp,
    StoreStatistics,
    Vacate,
)
from .blobs import Blobs
from .claims import SQLiteClaims, ofd_locks_available
from .saves import BLOB_ABOVE, has_blob
from .slots import SQLiteSlots
from .upkeep import Checkpoints
from .writer import Done, Job, SQLiteWriter, done_all, settle

if TYPE_CHECKING:
    from .admin import SQLiteAdmin

__all__ = ["SQLiteStore"]

logger = logging.getLogger("porch.store")

# How long close() at interpreter exit waits for the writer to finish its last batch.
_EXIT_JOIN = 10.0
# When the WAL is left after closing, another process had the file open: asked again after
# these pauses, in case it was closing at the same moment (see _last_out).
_LAST_OUT_PAUSES = (0.025, 0.05, 0.1)

# Up to this many hits, a batch arriving while the writer is idle commits on the event
# loop (durability="process" only): see SQLiteStore.apply_then.
INLINE_OPS = 4


class SQLiteStore(SQLiteWriter):
    """Counters and stored responses in ``<directory>/<filename>``, WAL mode.

    ``durability="process"`` (default) survives the process being killed at any
    point, including ``kill -9``: a committed transaction is in the WAL, handed
    to the OS. ``durability="power"`` also syncs the WAL at every group commit,
    so it survives a power loss or kernel crash.

    Idempotency claims are OFD write locks on one byte each of
    ``<filename>.locks`` beside the data file (Linux 3.15+). What frees a claim:
    a :class:`~porch.store.base.Save` or :class:`~porch.store.base.Release` with
    its token (the lock is dropped after the transaction's COMMIT — or after its
    ROLLBACK, which also ends the claim, storing nothing), :meth:`close`, or the
    holder's death: the kernel drops a process's OFD locks when its last
    descriptor of the file closes, which ``kill -9`` does at once. There is no
    lease, so ``Claim.retry_after`` is always ``None``; a frozen (SIGSTOPped)
    holder keeps its claims until it runs again or dies. Fence tokens come from
    a counter in the file, so they increase across every process sharing it;
    fencing itself is implied by the lock (nobody else can claim meanwhile).
    Without OFD locks (not Linux) claims are per process: counters stay exact
    across processes, but two processes may each run a key's handler.

    ``part_grace``: seconds after its last part a body streamed in parts that no row
    names (its owner died mid-stream) is deleted (see :class:`~porch.store.base.PartStore`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        filename: str = "porch.sqlite3",
        durability: Durability = "process",
        busy_timeout: float = 5.0,
        prune_batch: int = 64,
        upkeep_after: float = 1.0,
        clock: Clock | None = None,
        part_grace: float = PART_GRACE,
    ) -> None:
        if durability not in ("process", "power"):
            raise ConfigurationError(f"durability must be 'process' or 'power', got {durability!r}")
        if busy_timeout < 0:
            raise ConfigurationError(f"busy_timeout must be >= 0 seconds, got {busy_timeout}")
        if prune_batch < 1:
            raise ConfigurationError(f"prune_batch must be >= 1, got {prune_batch}")
        if not upkeep_after > 0:
            raise ConfigurationError(f"upkeep_after must be > 0 seconds, got {upkeep_after}")
        if not part_grace > 0:
            raise ConfigurationError(f"part_grace must be > 0 seconds, got {part_grace}")
        if not filename or os.sep in filename:
            raise ConfigurationError(f"filename must be a bare file name, got {filename!r}")
        self.path = Path(directory) / filename
        self.durability: Durability = durability
        self.busy_timeout = busy_timeout
        self.prune_batch = prune_batch
        # Idle this long, the writer prunes expired responses and gives pages back.
        self.upkeep_after = float(upkeep_after)
        self.clock: Clock = clock if clock is not None else SystemClock()
        # Used only from the writer thread.
        self._log = EventLog(logger)
        self._checkpoint_log = (threading.Lock(), EventLog(logger))
        # Idempotency owners of every process sharing this file lock keys here.
        self._claims = SQLiteClaims(self.path.with_name(self.path.name + ".locks"))
        self.claims: Claims = self._claims
        # Concurrency slots: rows named by this store's holder, whose lock is in that file.
        self._slots = SQLiteSlots(self._claims.locks)
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whoever uses the writer's connection holds this: the writer thread, or the
        # event loop committing a small batch inline (see apply_then).
        self._conn_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None  # set while the writer runs
        self._checkpoints: Checkpoints | None = None
        self._names: dict[str, int] = {}  # counter-name ids read (see counters._name_ids)
        self._inline_busy = False  # the connection's busy_timeout is 0 (an inline commit)
        self._inline: list[tuple[Sequence[StoreOp], Done]] = []  # to commit inline, if idle
        self._inline_ops = 0
        self._inline_loop: asyncio.AbstractEventLoop | None = None
        self._transactions = 0
        self._operations = 0
        self._failures = 0
        self._secret: bytes | None = None  # read from the file when it is opened
        # Bodies above 64 KiB: written by a thread of their own before their rows.
        self._blobs = Blobs(
            self.path,
            durability=durability,
            busy_timeout=busy_timeout,
            clock=self.clock,
            upkeep_after=self.upkeep_after,
            forward=self._queue_job,
            part_grace=float(part_grace),
        )
        self._bodies = self._blobs
        self.capabilities = Capabilities(
            # One shard, one batch at a time: the one writer thread commits every queued
            # batch in one transaction anyway, so more would only split a loop
            # iteration's requests into more batches, hand-offs and wake-ups.
            shards=1,
            in_flight=1,
            clock=self.clock,
            apply_then=self.apply_then,
            apply_now=self.apply_now if durability == "process" else None,
            solo_save_bytes=BLOB_ABOVE,
            admin=self.admin,
            algorithms=frozenset(ALGORITHMS),
            # Freed at once when the holding process dies: no lease (slot_lease None).
            slots=True,
            # Streamed bodies: parts in the side file, written by its thread.
            parts=self._blobs,
        )

    @property
    def secret(self) -> bytes:
        """The file's secret (schema 7; see :attr:`porch.store.base.Store.secret`)."""
        if self._secret is None:
            raise StoreError(f"the SQLite store {self.path} is not open")
        return self._secret

    @classmethod
    def temporary(cls, **options: Any) -> SQLiteStore:
        """A throwaway store for tests, in a new temporary directory; ``options`` as above.

        The same store as any other (WAL, group commit, OFD claims), so tests see
        production semantics; it starts empty, and its directory is removed once
        the store object is garbage-collected or the process exits — not on
        close(), so counters survive the pool moving to another event loop.
        """
        if "directory" in options:
            raise ConfigurationError("a temporary store makes its own directory: pass none")
        directory = tempfile.mkdtemp(prefix="porch-")
        store = cls(directory, **options)
        weakref.finalize(store, shutil.rmtree, directory, True)
        return store

    # -- lifecycle -----------------------------------------------------------------

    async def open(self) -> None:
        if self._thread is not None:
            return
        if not ofd_locks_available():
            logger.info(
                "porch: no open-file-description locks on this platform; idempotency "
                "ownership is per process (counters stay exact across processes)"
            )
        loop = asyncio.get_running_loop()
        self._loop = loop
        # A fresh queue: a stop marker left for a writer thread that is gone (this
        # process was forked from the one that ran it) must not stop the new one.
        self._queue = queue.SimpleQueue()
        ready: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._writer, args=(ready,), name=f"porch-sqlite:{self.path.name}", daemon=True
        )
        self._thread.start()
        try:
            await ready
            # After the data file (its directory made, its schema migrated).
            await asyncio.to_thread(self._blobs.open)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        try:
            # Bodies first: the side file's writer hands what it wrote on to the writer.
            await asyncio.to_thread(self._blobs.close)
            self._queue.put(None)
            await asyncio.to_thread(thread.join)
        except RuntimeError:
            # At interpreter exit (an atexit handler closing the pool) the default executor
            # takes no more work: wait here, so the writer still closes its connection
            # (and SQLite removes the WAL) before the process ends.
            self._blobs.close(_EXIT_JOIN)
            self._queue.put(None)
            thread.join(timeout=_EXIT_JOIN)
        self._blobs.close_reader()
        self._slots.close()
        self._claims.close()  # drops every claim (and the slots' holder) this process holds
        try:
            await asyncio.to_thread(_last_out, self.path)
        except RuntimeError:  # at interpreter exit, as above
            _last_out(self.path)

    def admin(self) -> SQLiteAdmin:
        """The operator's view of this file (``porch inspect|reset|purge|check``)."""
        from .admin import SQLiteAdmin

        return SQLiteAdmin(self.path, clock=self.clock, busy_timeout=self.busy_timeout)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self._transactions, self._operations, self._failures)

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        # The caller's loop settles it (the pool may have moved to another loop).
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.apply_then(ops, partial(settle, future))
        await future

    def apply_then(self, ops: Sequence[StoreOp], done: Done) -> None:
        """Apply ``ops`` in one transaction; then ``done(None)`` (or ``done(error)``).

        ``done`` runs on the calling loop, after the commit: from the writer
        thread's wake-up, or from an inline commit. With ``durability="process"``
        the hits and settles arriving in one loop iteration, at most INLINE_OPS of
        them, are committed together on the loop when the writer is idle: that COMMIT is a
        ``write()`` into the page cache, cheaper than the two thread switches and
        the wake-up of a hand-off (at one connection, most of a request's wait).
        Never with fsync, never a claim or a save, never while the writer holds
        the connection, and never waiting for another process's write lock
        (busy_timeout 0 there: a busy file goes to the writer). Under load the
        batches are bigger and go to the writer, which commits them (group
        commit) while the loop goes on serving requests.
        """
        if self._thread is None or self._loop is None:
            raise StoreError("the SQLite store is not open")
        loop = asyncio.get_running_loop()
        if any(has_blob(op) for op in ops):
            self._blobs.send((ops, loop, done))  # its body first, then the batch comes here
            return
        if (
            self.durability == "process"
            and len(ops) + self._inline_ops <= INLINE_OPS
            and all(type(op) is Hit or type(op) is Settle or type(op) is Vacate for op in ops)
        ):
            if not self._inline or self._inline_loop is not loop:
                # (Left by a loop that stopped before its flush ran: nobody waits for those.)
                self._inline, self._inline_ops, self._inline_loop = [], 0, loop
                loop.call_soon(self._flush_inline)
            self._inline.append((ops, done))
            self._inline_ops += len(ops)
            return
        self._queue.put((ops, loop, done))

    def _queue_job(self, job: Job) -> None:
        self._queue.put(job)

    def apply_now(self, ops: Sequence[StoreOp]) -> bool:
        """Commit ``ops`` on the calling thread now, if that is cheap: True once committed;
        False if nothing was applied (the caller sends them through ``apply_then``).

        The same inline commit as a small batch's (see ``apply_then``), without its wait
        for the end of the loop iteration: only hits and settles, only ``durability="process"``,
        never while the writer has work or holds the connection, never while this
        loop's hits wait for their flush (they go first), never waiting for another
        process's write lock. A failed commit is rolled back: nothing was applied.
        """
        if (
            self.durability != "process"
            or self._thread is None
            or self._inline
            or not self._queue.empty()
            or not all(type(op) is Hit or type(op) is Settle or type(op) is Vacate for op in ops)
        ):
            return False
        return self._commit_inline(list(ops))

    def _flush_inline(self) -> None:
        """This loop iteration's hits: committed here if the writer is idle, else queued."""
        jobs, self._inline, self._inline_ops = self._inline, [], 0
        ops = [op for batch, _ in jobs for op in batch]
        error: BaseException | None = None
        if self._thread is None:
            error = StoreError("the SQLite store closed before this batch was applied")
        elif not self._queue.empty() or not self._commit_inline(ops):
            loop = asyncio.get_running_loop()
            for batch, done in jobs:
                self._queue.put((batch, loop, done))
            return
        done_all([done for _, done in jobs], error)

    def _commit_inline(self, ops: list[StoreOp]) -> bool:
        """Commit ``ops`` on this thread if the writer's connection is free; False if not."""
        conn = self._conn
        if conn is None or not self._conn_lock.acquire(blocking=False):
            return False
        try:
            if not self._inline_busy:
                conn.execute("PRAGMA busy_timeout = 0")
                self._inline_busy = True
            self._transaction(conn, ops)
            if self._checkpoints is not None:
                # Never a catch-up copy here: it would stall the loop (the writer does it).
                self._checkpoints.committed(conn, catch_up=False)
        except Exception:
            return False  # rolled back: the writer applies it (and reports what fails)
        finally:
            self._conn_lock.release()
        return True


def _last_out(path: Path) -> None:
    """Remove the WAL if this process was, in the end, the file's last user.

    SQLite checkpoints and deletes the WAL when the last connection to the file closes,
    and only if it gets the file's exclusive lock then. Two processes closing at the same
    moment (gunicorn's workers told to stop together) can each see the other still open,
    and both leave the WAL (harmless: it is recovered at the next open, but a store shut
    down cleanly should leave none). A connection opened and closed again once the other
    has gone does it; if another process keeps the file open, nothing happens here and
    that process's own close removes it later.
    """
    wal = path.with_name(path.name + "-wal")
    for pause in _LAST_OUT_PAUSES:
        if not wal.exists():
            return
        time.sleep(pause)
        try:
            # mode=rw: never create the file (a store directory removed meanwhile).
            connection = sqlite3.connect(path.absolute().as_uri() + "?mode=rw", uri=True, timeout=0)
            try:
                connection.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            finally:
                connection.close()
        except sqlite3.Error:
            return  # busy or gone: whoever has it open closes it
