"""The SQLite store's writer thread: one connection, group commits, upkeep when idle.

Every operation goes to this thread (the event loop never blocks on SQLite). It
takes whatever batches are queued — from any shard — and applies them in one
``BEGIN IMMEDIATE`` transaction: group commit. The write lock taken by ``BEGIN
IMMEDIATE`` is also what serializes several processes sharing the file, so a
decision is always read-decide-write under the lock, never a read-modify-write
from a request task. Small batches of hits may commit on the event loop instead,
when the thread is idle (inline: see :meth:`SQLiteWriter.apply_then`).
:class:`~.store.SQLiteStore` holds one writer and is the public surface on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..._eventlog import EventLog
from ..._files import private_directory, private_file, tighten
from ..._futures import resolve
from ...clock import Clock
from ...errors import StoreError
from ..base import Durability, Hit, Release, Save, Settle, StoreOp, StoreStatistics, Vacate
from .claims import SQLiteClaims
from .ops import apply_batch
from .saves import Bodies, Heads, has_blob
from .schema import (
    check_not_foreign,
    enable_incremental_vacuum,
    migrate,
    read_secret,
    rebase_after_reboot,
)
from .slots import SQLiteSlots
from .upkeep import (
    FREE_PAGES,
    HOLD_POLL,
    STOP_WITHIN,
    UPKEEP_PAGES,
    WAL_LIMIT,
    Checkpoints,
    FairBatches,
    give_back,
    join_within,
    upkeep,
)

__all__ = [
    "CACHE_KIB",
    "INLINE_OPS",
    "Done",
    "Job",
    "SQLiteWriter",
    "SideFile",
    "call_soon",
    "done_all",
    "open_private",
]

logger = logging.getLogger("porch.store")

# The writer's page cache (KiB): the hot part of a million counter rows.
CACHE_KIB = 16 << 10

# Up to this many ops (hits, settles, a slot's vacate), a loop iteration's batch arriving
# while the writer is idle commits on the event loop (durability="process" only): see
# SQLiteWriter.apply_then. 16 against 4 bought 7% at 16 connections and left 64 and 256
# as they were; 64 bought no more and cost the tail at 64 connections (benchmarks/ab.py
# --env BENCH_INLINE_OPS, docs/benchmarks.md).
INLINE_OPS = 16

# A busy writer counts the file's free pages on every this many transactions.
_FREELIST_EVERY = 8

# Called on the caller's loop with None once the batch committed, or with its error.
Done = Callable[[BaseException | None], None]
Job = tuple[Sequence[StoreOp], asyncio.AbstractEventLoop, Done]


class SideFile(Bodies, Protocol):
    """The side file of big bodies (:class:`~.blobs.Blobs`), as the writer uses it: it
    reads bodies from it, and sends it the batches whose bodies go there first."""

    def send(self, job: Job) -> None: ...


class SQLiteWriter:
    """The store's one writer: its thread and connection, the queue of batches it commits
    together, and the small batches committed on the event loop instead (inline).

    :class:`~.store.SQLiteStore` holds one and forwards to it; ``claims`` and ``slots``
    are the store's (their locks outlive a writer thread), ``bodies`` its side file.
    """

    def __init__(
        self,
        path: Path,
        *,
        durability: Durability,
        busy_timeout: float,
        prune_batch: int,
        upkeep_after: float,
        clock: Clock,
        claims: SQLiteClaims,
        slots: SQLiteSlots,
        bodies: SideFile,
    ) -> None:
        self.path = path
        self.durability: Durability = durability
        self.busy_timeout = busy_timeout
        self.prune_batch = prune_batch
        self.upkeep_after = upkeep_after
        self.clock = clock
        self._claims = claims
        self._slots = slots
        self._bodies = bodies
        # Used only from the writer thread.
        self._log = EventLog(logger)
        self._checkpoint_log = (threading.Lock(), EventLog(logger))
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # from start() to stop()
        self._stopping: threading.Thread | None = None  # from stop() to join()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whoever uses the connection holds this: the writer thread, or the event
        # loop committing a small batch inline (see apply_then).
        self._conn_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None  # set while the thread runs
        self._checkpoints: Checkpoints | None = None
        self._names: dict[str, int] = {}  # counter-name ids read (see counters._name_ids)
        self._heads: Heads = {}  # response heads' stored forms (saves.headers_json)
        self._inline_busy = False  # the connection's busy_timeout is 0 (an inline commit)
        self._inline: list[tuple[Sequence[StoreOp], Done]] = []  # to commit inline, if idle
        self._inline_ops = 0
        self._inline_loop: asyncio.AbstractEventLoop | None = None
        self._transactions = 0
        self._operations = 0
        self._failures = 0
        #: The file's secret, read when the thread opens it (None before).
        self.secret: bytes | None = None

    # -- lifecycle -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Between :meth:`start` and :meth:`stop`: batches are taken."""
        return self._thread is not None

    async def start(self) -> None:
        """Start the thread; return once its connection is open (the file's directory
        made, its schema migrated). Raises StoreError; after a failure (or a cancellation)
        :meth:`stop` and :meth:`join` still apply."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        # A fresh queue: a stop marker left for a writer thread that is gone (this
        # process was forked from the one that ran it) must not stop the new one.
        self._queue = queue.SimpleQueue()
        ready: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name=f"porch-sqlite:{self.path.name}", daemon=True
        )
        self._thread.start()
        await ready

    def stop(self) -> bool:
        """Take no more batches from callers (:meth:`apply_then` refuses, :meth:`apply_now`
        declines); what is queued, and what :meth:`submit` still brings, is committed
        before :meth:`join` ends the thread. False if it was not running."""
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        self._stopping = thread
        return True

    def join(self, timeout: float = STOP_WITHIN) -> None:
        """After :meth:`stop`: commit what is queued, close the connection, end the thread
        (blocking: waits ``timeout`` seconds at most, then leaves it with a warning)."""
        thread = self._stopping
        if thread is not None:
            self._queue.put(None)
            join_within(thread, timeout)
            if not thread.is_alive():
                self._stopping = None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self._transactions, self._operations, self._failures)

    # -- batches -------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a batch for the thread, as it is (the side file's, once its bodies committed)."""
        self._queue.put(job)

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
            self._bodies.send((ops, loop, done))  # its body first, then the batch comes here
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

    def queued(self) -> int:
        """Batches waiting for the thread (roughly: see ``queue.SimpleQueue.qsize``)."""
        return self._queue.qsize()

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

    # -- the thread ----------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Client addresses and response bodies: owner-only, whatever the umask. The WAL
        # and shared-memory files SQLite creates take the database file's mode.
        private_directory(self.path.parent)
        private_file(self.path)
        return open_private(self.path, self.busy_timeout, self._prepare)

    def _prepare(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        check_not_foreign(conn)  # before anything could rewrite someone else's file
        try:
            if enable_incremental_vacuum(conn):
                logger.info("porch: %s switched to incremental vacuum (one VACUUM)", self.path)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise  # another worker is opening the file: retried by _connect
            logger.warning("porch: cannot switch %s to incremental vacuum: %s", self.path, exc)
        conn.execute("PRAGMA journal_mode = WAL")
        # A checkpointed WAL is cut back to this size instead of keeping its peak.
        conn.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT}")
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'power' else 'NORMAL'}")
        # Many distinct keys spread their rows over many pages; past SQLite's default
        # 2 MiB of cache each batch would read them back from the OS, page by page.
        conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            migrate(conn)
            self.secret = read_secret(conn)
            if rebase_after_reboot(
                conn, self.clock.boot_id(), self.clock.monotonic(), self.clock.wall()
            ):
                logger.info("porch: rebased stored windows after a reboot (%s)", self.path)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _main(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        if loop is None:  # pragma: no cover - start() sets it before starting the thread
            return
        try:
            conn = self._connect()
        except Exception as exc:
            failed = StoreError(f"cannot open SQLite store {self.path}: {exc}")
            call_soon(loop, resolve, ready, failed)
            return
        checkpoints = Checkpoints(self._checkpointer, self._checkpoint_failed, self._wake)
        checkpoints.start(conn, f"porch-checkpoint:{self.path.name}")
        self._checkpoints = checkpoints
        self._names = {}
        self._heads = {}
        self._conn = conn
        call_soon(loop, resolve, ready, None)
        try:
            self._serve(conn, checkpoints)
        finally:
            with self._conn_lock:
                self._conn = None
                self._checkpoints = None
            checkpoints.stop()  # first: the last connection to close checkpoints the WAL
            conn.close()

    def _wake(self) -> None:
        """From the checkpoint thread: a catch-up is due, and only a writer's transaction
        runs it; with commits on the loop the writer may have none (an empty one does)."""
        loop = self._loop
        if loop is not None:
            self._queue.put(((), loop, _ignore))

    def _checkpointer(self) -> sqlite3.Connection:
        return sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )

    def _checkpoint_failed(self, exc: sqlite3.Error) -> None:
        with self._checkpoint_log[0]:  # from the writer's thread or the checkpointer's
            self._checkpoint_log[1].event(
                logging.WARNING,
                "checkpoint",
                self.clock.monotonic(),
                60.0,
                "porch: WAL checkpoint of %s failed: %s",
                self.path,
                exc,
                cause="store",
                store=str(self.path),
            )

    def _serve(self, conn: sqlite3.Connection, checkpoints: Checkpoints) -> None:
        """Group commits until close(); upkeep when idle (see :mod:`.upkeep`)."""
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        # Bodies in the side file came committed: their rows are small.
        fair: FairBatches[Job] = FairBatches(lambda job: [op for op in job[0] if not has_blob(op)])
        stopping = False
        idle_work = True  # after a batch, the next idle moment runs an upkeep
        upkept = -1  # transactions committed by the last upkeep's time
        while True:
            arrived: list[Job] = []
            holding = checkpoints.holding
            if (holding or not fair) and not stopping:
                try:
                    # Inline commits (see apply_then) leave work for upkeep too: while they
                    # may come, the writer looks every upkeep_after seconds. While big saves
                    # are held for a checkpoint, it looks often for that checkpoint's end.
                    inline = self.durability == "process"
                    wait = HOLD_POLL if holding else self.upkeep_after
                    # Slots a failed transaction freed wait to be written: look again soon.
                    timed = idle_work or inline or holding or self._slots.pending()
                    job = get(timeout=wait) if timed else get()
                except queue.Empty:
                    with self._conn_lock:
                        if self._slots.pending() and self._loop is not None:
                            self._writer_owns(conn)
                            self._run(conn, [((), self._loop, _ignore)])
                        if holding:
                            self._writer_owns(conn)
                            checkpoints.committed(conn)
                        elif idle_work or self._transactions != upkept:
                            self._writer_owns(conn)
                            idle_work = self._upkeep(conn)
                            upkept = self._transactions
                            checkpoints.committed(conn)
                    continue
                if job is None:
                    stopping = True
                else:
                    arrived.append(job)
                    idle_work = True
            # Group commit: everything queued by now joins this transaction (big saves
            # beyond the cap wait for the next one).
            while not stopping:
                try:
                    more = get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                else:
                    arrived.append(more)
            jobs = fair.next_transaction(arrived, hold_big=checkpoints.holding and not stopping)
            if jobs:
                with self._conn_lock:
                    self._writer_owns(conn)
                    self._run(conn, jobs)
                    checkpoints.committed(conn)  # after the replies are on their way
            if stopping and not fair:
                return

    def _writer_owns(self, conn: sqlite3.Connection) -> None:
        """The writer waits for other processes' write locks again (an inline commit never)."""
        if self._inline_busy:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            self._inline_busy = False

    def _run(self, conn: sqlite3.Connection, jobs: list[Job]) -> None:
        error: BaseException | None = None
        try:
            self._transaction(conn, [op for ops, _, _ in jobs for op in ops])
        except Exception as exc:
            self._failures += 1
            # Throttled (once a second, with a count): a full disk fails every batch.
            self._log.event(
                logging.ERROR,
                "transaction",
                self.clock.monotonic(),
                1.0,
                "porch: SQLite transaction failed on %s: %s",
                self.path,
                exc,
                cause="store",
                store=str(self.path),
            )
            error = (
                exc
                if isinstance(exc, StoreError)
                else StoreError(f"SQLite store {self.path}: {exc}")
            )
            # Not retried: slots its vacates free stay free all the same.
            self._slots.keep([op for ops, _, _ in jobs for op in ops])
        first = jobs[0][1]
        if all(loop is first for _, loop, _ in jobs):
            call_soon(first, done_all, [done for _, _, done in jobs], error)
        else:
            for _, loop, done in jobs:
                call_soon(loop, done, error)

    def _upkeep(self, conn: sqlite3.Connection) -> bool:
        try:
            return upkeep(conn, self.clock.monotonic)
        except sqlite3.Error as exc:
            self._log.event(
                logging.WARNING,
                "upkeep",
                self.clock.monotonic(),
                60.0,
                "porch: idle upkeep of %s failed: %s",
                self.path,
                exc,
                cause="store",
                store=str(self.path),
            )
            return True

    def _transaction(self, conn: sqlite3.Connection, ops: list[StoreOp]) -> None:
        claims = self._claims
        slots = self._slots
        try:
            conn.execute("BEGIN IMMEDIATE")
            slots.begin()
            # The clock is read under the write lock, so every process decides on
            # times that are ordered the same way as their transactions.
            now = self.clock.monotonic()
            wall = self.clock.wall()
            names, bodies, heads = self._names, self._bodies, self._heads
            apply_batch(conn, ops, now, wall, self.prune_batch, claims, names, bodies, heads, slots)
            if self._transactions % _FREELIST_EVERY == 0:
                # A busy store is never idle: give back a little at a time. Looked at
                # on every few transactions only: it is one more statement each time.
                (free,) = conn.execute("PRAGMA freelist_count").fetchone()
                if free > FREE_PAGES:
                    give_back(conn, UPKEEP_PAGES // 4)
            conn.execute("COMMIT")
        except BaseException:
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            finally:
                # Claims taken by this transaction end with it; so do the claims its
                # saves and releases were ending (nothing was stored).
                claims.rolled_back()
                slots.rolled_back()
                if claims.holds_any():
                    _end_claims(claims, ops)
            raise
        claims.committed()
        slots.committed()
        if claims.holds_any():
            _end_claims(claims, ops)
        self._transactions += 1
        self._operations += len(ops)


def _end_claims(claims: SQLiteClaims, ops: list[StoreOp]) -> None:
    """After COMMIT or ROLLBACK: unlock the keys whose claims the batch's saves and releases
    end (a fenced save names a token that is no longer current: it ends nothing)."""
    for op in ops:
        if (type(op) is Save or type(op) is Release) and claims.current(op.key, op.token):
            claims.end(op.key)


def call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    # A stopped and closed loop has nobody left to answer; the writer must live on.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _ignore(error: BaseException | None) -> None:
    """The reply to the writer's wake-up transaction: nobody waits for it."""


def done_all(dones: list[Done], error: BaseException | None) -> None:
    for done in dones:
        try:
            done(error)
        except Exception:  # one caller's failing reply must not strand the others
            logger.exception("porch: a reply to a committed batch failed")


def open_private(
    path: Path, busy_timeout: float, prepare: Callable[[sqlite3.Connection], None]
) -> sqlite3.Connection:
    """A connection to ``path`` (created 0600 beforehand), ``prepare``d, its WAL and
    shared-memory files owner-only. Raises sqlite3.Error.

    Several worker processes start at once on one file: switching a new file to WAL
    answers "locked" without waiting, so the opening is retried (with a short sleep:
    this is start-up, in a worker thread) for ``busy_timeout``.
    """
    waited, delay = 0.0, 0.005
    while True:
        conn = sqlite3.connect(
            path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            prepare(conn)
            # Known to be porch's file now: an earlier version created it 0644.
            for suffix in ("", "-wal", "-shm"):
                tighten(path.with_name(path.name + suffix))
            return conn
        except sqlite3.OperationalError as exc:
            conn.close()
            busy = "locked" in str(exc) or "busy" in str(exc)
            if not busy or waited >= max(busy_timeout, 0.1):
                raise
            time.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.1)
        except BaseException:
            conn.close()
            raise
