"""The embedded default store: one SQLite file in WAL mode, written by one thread.

Every operation goes to a dedicated writer thread (the event loop never blocks
on SQLite). The thread takes whatever batches are queued — from any shard —
and applies them in one ``BEGIN IMMEDIATE`` transaction: group commit. The
write lock taken by ``BEGIN IMMEDIATE`` is also what serializes several
processes sharing the file, so a decision is always read-decide-write under
the lock, never a read-modify-write from a request task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import shutil
import sqlite3
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._files import private_directory, private_file, tighten
from ...clock import Clock, SystemClock
from ...errors import ConfigurationError, StoreError
from ...eventlog import EventLog
from ..base import Claims, Durability, Hit, Release, Save, StoreOp, StoreStatistics
from .claims import SQLiteClaims, ofd_locks_available
from .ops import apply_batch
from .schema import check_not_foreign, enable_incremental_vacuum, migrate, rebase_after_reboot
from .upkeep import (
    FREE_PAGES,
    HOLD_POLL,
    UPKEEP_PAGES,
    WAL_LIMIT,
    Checkpoints,
    FairBatches,
    give_back,
    upkeep,
)

if TYPE_CHECKING:
    from .admin import SQLiteAdmin

__all__ = ["SQLiteStore"]

logger = logging.getLogger("porch.store")

# How long close() at interpreter exit waits for the writer to finish its last batch.
_EXIT_JOIN = 10.0

# The writer's page cache (KiB): the hot part of a million counter rows.
CACHE_KIB = 16 << 10

# A busy writer counts the file's free pages on every this many transactions.
_FREELIST_EVERY = 8

# Up to this many hits, a batch arriving while the writer is idle commits on the event
# loop (durability="process" only): see SQLiteStore.apply_then.
INLINE_OPS = 4

# Called on the caller's loop with None once the batch committed, or with its error.
Done = Callable[[BaseException | None], None]
_Job = tuple[Sequence[StoreOp], asyncio.AbstractEventLoop, Done]


class SQLiteStore:
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
    """

    # One batch per shard at a time: the one writer thread commits them in turn anyway.
    in_flight = 1

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
    ) -> None:
        if durability not in ("process", "power"):
            raise ConfigurationError(f"durability must be 'process' or 'power', got {durability!r}")
        if busy_timeout < 0:
            raise ConfigurationError(f"busy_timeout must be >= 0 seconds, got {busy_timeout}")
        if prune_batch < 1:
            raise ConfigurationError(f"prune_batch must be >= 1, got {prune_batch}")
        if not upkeep_after > 0:
            raise ConfigurationError(f"upkeep_after must be > 0 seconds, got {upkeep_after}")
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
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whoever uses the writer's connection holds this: the writer thread, or the
        # event loop committing a small batch inline (see apply_then).
        self._conn_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None  # set while the writer runs
        self._checkpoints: Checkpoints | None = None
        self._names: dict[str, int] = {}  # counter-name ids read (see ops._name_ids)
        self._inline_busy = False  # the connection's busy_timeout is 0 (an inline commit)
        self._inline: list[tuple[Sequence[StoreOp], Done]] = []  # to commit inline, if idle
        self._inline_ops = 0
        self._inline_loop: asyncio.AbstractEventLoop | None = None
        self._transactions = 0
        self._operations = 0
        self._failures = 0

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
        except BaseException:
            self._thread = None
            raise

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        self._queue.put(None)
        try:
            await asyncio.to_thread(thread.join)
        except RuntimeError:
            # At interpreter exit (an atexit handler closing the pool) the default executor
            # takes no more work: wait here, so the writer still closes its connection
            # (and SQLite removes the WAL) before the process ends.
            thread.join(timeout=_EXIT_JOIN)
        self._claims.close()  # drops every claim this process still holds

    def admin(self) -> SQLiteAdmin:
        """The operator's view of this file (``porch inspect|reset|purge|check``)."""
        from .admin import SQLiteAdmin

        return SQLiteAdmin(self.path, clock=self.clock, busy_timeout=self.busy_timeout)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self._transactions, self._operations, self._failures)

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        # The caller's loop settles it (the pool may have moved to another loop).
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.apply_then(ops, partial(_settle, future))
        await future

    def apply_then(self, ops: Sequence[StoreOp], done: Done) -> None:
        """Apply ``ops`` in one transaction; then ``done(None)`` (or ``done(error)``).

        ``done`` runs on the calling loop, after the commit: from the writer
        thread's wake-up, or from an inline commit. With ``durability="process"``
        the hits arriving in one loop iteration, at most INLINE_OPS of them, are
        committed together on the loop when the writer is idle: that COMMIT is a
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
        if (
            self.durability == "process"
            and len(ops) + self._inline_ops <= INLINE_OPS
            and all(type(op) is Hit for op in ops)
        ):
            if not self._inline or self._inline_loop is not loop:
                # (Left by a loop that stopped before its flush ran: nobody waits for those.)
                self._inline, self._inline_ops, self._inline_loop = [], 0, loop
                loop.call_soon(self._flush_inline)
            self._inline.append((ops, done))
            self._inline_ops += len(ops)
            return
        self._queue.put((ops, loop, done))

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
        _done_all([done for _, done in jobs], error)

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

    # -- the writer thread -----------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Client addresses and response bodies: owner-only, whatever the umask. The WAL
        # and shared-memory files SQLite creates take the database file's mode.
        private_directory(self.path.parent)
        private_file(self.path)
        # Several worker processes start at once on one file: switching a new file
        # to WAL answers "locked" without waiting, so the opening is retried (with
        # a short sleep: this is start-up, in the writer thread) for busy_timeout.
        waited, delay = 0.0, 0.005
        while True:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
            )
            try:
                self._prepare(conn)
                # Known to be porch's file now: an earlier version created it 0644.
                for suffix in ("", "-wal", "-shm"):
                    tighten(self.path.with_name(self.path.name + suffix))
                return conn
            except sqlite3.OperationalError as exc:
                conn.close()
                busy = "locked" in str(exc) or "busy" in str(exc)
                if not busy or waited >= max(self.busy_timeout, 0.1):
                    raise
                time.sleep(delay)
                waited += delay
                delay = min(delay * 2, 0.1)
            except BaseException:
                conn.close()
                raise

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
            if rebase_after_reboot(
                conn, self.clock.boot_id(), self.clock.monotonic(), self.clock.wall()
            ):
                logger.info("porch: rebased stored windows after a reboot (%s)", self.path)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _writer(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        if loop is None:  # pragma: no cover - open() sets it before starting the thread
            return
        try:
            conn = self._connect()
        except Exception as exc:
            failed = StoreError(f"cannot open SQLite store {self.path}: {exc}")
            _call_soon(loop, _settle, ready, failed)
            return
        checkpoints = Checkpoints(self._checkpointer, self._checkpoint_failed)
        checkpoints.start(conn, f"porch-checkpoint:{self.path.name}")
        self._checkpoints = checkpoints
        self._names = {}
        self._conn = conn
        _call_soon(loop, _settle, ready, None)
        try:
            self._serve(conn, checkpoints)
        finally:
            with self._conn_lock:
                self._conn = None
                self._checkpoints = None
            checkpoints.stop()  # first: the last connection to close checkpoints the WAL
            conn.close()

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
        fair: FairBatches[_Job] = FairBatches(lambda job: job[0])
        stopping = False
        idle_work = True  # after a batch, the next idle moment runs an upkeep
        upkept = -1  # transactions committed by the last upkeep's time
        while True:
            arrived: list[_Job] = []
            holding = checkpoints.holding
            if (holding or not fair) and not stopping:
                try:
                    # Inline commits (see apply_then) leave work for upkeep too: while they
                    # may come, the writer looks every upkeep_after seconds. While big saves
                    # are held for a checkpoint, it looks often for that checkpoint's end.
                    inline = self.durability == "process"
                    wait = HOLD_POLL if holding else self.upkeep_after
                    job = get(timeout=wait) if idle_work or inline or holding else get()
                except queue.Empty:
                    with self._conn_lock:
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

    def _run(self, conn: sqlite3.Connection, jobs: list[_Job]) -> None:
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
        first = jobs[0][1]
        if all(loop is first for _, loop, _ in jobs):
            _call_soon(first, _done_all, [done for _, _, done in jobs], error)
        else:
            for _, loop, done in jobs:
                _call_soon(loop, done, error)

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
        try:
            conn.execute("BEGIN IMMEDIATE")
            # The clock is read under the write lock, so every process decides on
            # times that are ordered the same way as their transactions.
            now = self.clock.monotonic()
            wall = self.clock.wall()
            apply_batch(conn, ops, now, wall, self.prune_batch, claims, self._names)
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
                if claims.holds_any():
                    _end_claims(claims, ops)
            raise
        claims.committed()
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


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    # A stopped and closed loop has nobody left to answer; the writer must live on.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _done_all(dones: list[Done], error: BaseException | None) -> None:
    for done in dones:
        try:
            done(error)
        except Exception:  # one caller's failing reply must not strand the others
            logger.exception("porch: a reply to a committed batch failed")
