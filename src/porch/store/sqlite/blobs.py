"""Big response bodies in a side file with a writer thread of its own (issue 12).

A save of a body above ``BLOB_ABOVE`` never occupies the decision writer: the
body goes first to ``<stem>-blobs<suffix>`` beside the data file (owner-only,
WAL, the same ``synchronous`` setting), written by this module's thread on its
own connection, where its INSERT, its WAL growth and that file's checkpoints
delay only other big saves. Once the body committed, the Save goes on to the
decision writer, whose ``responses`` row holds everything but the body and
names it by ``blob`` (a random 63-bit id; the blob row repeats the key, so a
row never reads another key's body). Quotas count the row's ``size``, which
includes the body wherever it lives.

Body first, row second: a crash (``kill -9``) between the two leaves a body no
row names — an orphan — and never a row naming a missing body. Orphans (and
bodies whose row expired, was replaced or deleted) are found by the sweep:
blobs older than ``ORPHAN_GRACE`` (wall time; longer than any save stays
between its two commits) that no ``responses`` row names are deleted, and free
pages given back (``auto_vacuum = INCREMENTAL``, as the data file). A save that
ends without its row (fenced, over quota, failed) drops its body at once.

A row whose body is gone all the same (``durability="process"`` promises
nothing about a power loss, and the two files are synced apart) is read as no
stored response and deleted: its key is served again.

Bodies too big to hold whole in memory are streamed here in parts (this class is
the store's :class:`~porch.store.base.PartStore`): each part a row of ``parts``,
written by the same thread as it comes, read back one at a time by a replay (on
connections of its own, in worker threads). Their record names them by ``blob``
as it names a whole body. A body whose parts no row names is deleted by the sweep
once its newest part is ``PART_GRACE`` old (an owner that died mid-stream, or
whose response was not stored), and a lookup reads a row whose parts are not all
there (count, length) as no stored response, as above.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from ..._files import private_file
from ..._futures import resolve
from ...clock import Clock
from ...errors import StoreError
from ..base import PART_GRACE, Durability, Parts, Release, Save
from .saves import BLOB_ABOVE, has_blob
from .schema import statements
from .upkeep import FREE_PAGES, STOP_WITHIN, give_back, join_within
from .writer import Job, open_private

__all__ = ["BLOB_ABOVE", "ORPHAN_GRACE", "PART_BYTES", "Blobs", "blob_path", "has_blob"]

logger = logging.getLogger("porch.store")

# A blob no row names is deleted once it is this many wall seconds old.
ORPHAN_GRACE = 60.0
# Bodies written in one side-file transaction (at least one job's).
_COMMIT_BYTES = 4 << 20
# The side file's WAL, kept short (the data file's WAL_LIMIT is for many small rows).
_WAL_LIMIT = 1 << 20
_CHUNK = 256
# The parts of a body streamed here (the last may be shorter).
PART_BYTES = 1 << 20
# A part write is answered within this much past the side file's busy_timeout.
_PART_DEADLINE = 30.0

_SCHEMA = """
    CREATE TABLE IF NOT EXISTS blobs (
        id      INTEGER PRIMARY KEY,
        key     TEXT NOT NULL,
        written REAL NOT NULL,
        body    BLOB NOT NULL
    );
    CREATE INDEX IF NOT EXISTS blobs_written ON blobs (written);
    CREATE TABLE IF NOT EXISTS parts (
        blob    INTEGER NOT NULL,
        seq     INTEGER NOT NULL,
        key     TEXT NOT NULL,
        written REAL NOT NULL,
        body    BLOB NOT NULL
    );
    CREATE UNIQUE INDEX IF NOT EXISTS parts_blob ON parts (blob, seq);
    CREATE INDEX IF NOT EXISTS parts_written ON parts (written);
"""
_TABLES = frozenset({"blobs", "parts"})


class _PartWrite:
    """A part to write, and the future its writer awaits (resolved on its loop)."""

    __slots__ = ("blob", "data", "future", "key", "loop", "seq")

    def __init__(
        self,
        blob: int,
        seq: int,
        key: str,
        data: bytes,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
    ) -> None:
        self.blob = blob
        self.seq = seq
        self.key = key
        self.data = data
        self.loop = loop
        self.future = future

    def reply(self, error: BaseException | None) -> None:
        """From the side file's thread: the part is written (or ``error``)."""
        self.loop.call_soon_threadsafe(resolve, self.future, error)


def blob_path(path: Path) -> Path:
    """The side file of the data file at ``path``: ``porch.sqlite3`` -> ``porch-blobs.sqlite3``."""
    return path.with_name(f"{path.stem}-blobs{path.suffix}")


class Blobs:
    """The side file: its writer thread (bodies, parts, drops, sweeps), the decision
    writer's reader of it, and the store's PartStore (streamed bodies, in parts).
    ``forward`` hands a job whose bodies committed to the decision writer."""

    part_bytes = PART_BYTES

    def __init__(
        self,
        data: Path,
        *,
        durability: Durability,
        busy_timeout: float,
        clock: Clock,
        upkeep_after: float,
        forward: Callable[[Job], None],
        part_grace: float = PART_GRACE,
    ) -> None:
        self.data = data
        self.path = blob_path(data)
        self.durability: Durability = durability
        self.busy_timeout = busy_timeout
        self.clock = clock
        self.upkeep_after = upkeep_after
        self._forward = forward
        self.part_grace = part_grace
        # id(Save) -> its blob, from the body's commit until the job's reply.
        self.placed: dict[int, int] = {}
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None  # the decision writer's
        self._main: sqlite3.Connection | None = None  # the sweep's view of the data file
        # Idle connections of the replays' part reads (worker threads, one at a time each).
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()

    # -- lifecycle (blocking: called through asyncio.to_thread) ----------------------

    def open(self) -> None:
        """Create or open the side file and start its writer thread."""
        self._queue = queue.SimpleQueue()  # (see SQLiteStore.open: no stale stop marker)
        # Connections of a process this one was forked from are not this process's to use.
        self._reader = self._main = None
        conn = self._connect()
        self._thread = threading.Thread(
            target=self._run, args=(conn,), name=f"porch-blobs:{self.path.name}", daemon=True
        )
        self._thread.start()

    def close(self, within: float = STOP_WITHIN) -> None:
        """Write what is queued, forward it, stop the thread (``within`` seconds at most)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            join_within(thread, within)

    def close_reader(self) -> None:
        """After the decision writer stopped: close its connection to the side file, and
        the idle part readers' (one in use closes when it comes back)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        with self._readers_lock:
            readers, self._readers = self._readers, []
        for conn in readers:
            conn.close()

    def _connect(self) -> sqlite3.Connection:
        private_file(self.path)  # bodies are what the data file keeps: owner-only too
        try:
            return open_private(self.path, self.busy_timeout, self._prepare)
        except sqlite3.OperationalError as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from exc

    def _prepare(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        tables = {
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        }
        if tables - _TABLES:
            raise StoreError(f"{self.path} is not porch's side file; refusing to change it")
        (mode,) = conn.execute("PRAGMA auto_vacuum").fetchone()
        if mode != 2 and not tables:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # taken as the file is created
        conn.execute("PRAGMA journal_mode = WAL")
        # Every page of a body passes through the WAL once: a short WAL, checkpointed and
        # cut back often, keeps the bodies' bytes on disk near their quota, not the data
        # file's WAL_LIMIT (16 MiB) above.
        conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}")
        conn.execute(f"PRAGMA wal_autocheckpoint = {_WAL_LIMIT // 4096}")
        # The same promise as the data file: with "power" a body is synced before its row.
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'power' else 'NORMAL'}")
        for statement in statements(_SCHEMA):
            conn.execute(statement)

    # -- the event loop --------------------------------------------------------------

    def send(self, job: Job) -> None:
        """Write the job's big bodies, then forward it (its reply drops unused bodies)."""
        if self._thread is None:
            raise StoreError("the SQLite store is not open")
        self._queue.put(job)

    # -- the decision writer ---------------------------------------------------------

    def find(self, blob: int, key: str, length: int) -> bytes | Parts | None:
        """The body of ``key`` kept as ``blob`` (``length`` bytes): whole, or in parts (then
        their reference); None if the side file lost it, or some of its parts."""
        reader = self._reader
        if reader is None:
            reader = self._reader = self._connect_reader()
        row = reader.execute("SELECT body FROM blobs WHERE id = ? AND key = ?", (blob, key))
        found = row.fetchone()
        if found is not None:
            return bytes(found[0])
        return _whole(reader, blob, key, length)

    def _connect_reader(self) -> sqlite3.Connection:
        return sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )

    # -- the PartStore (on the event loop; blocking work in threads) --------------------

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        if self._thread is None:
            raise StoreError("the SQLite store is not open")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(_PartWrite(body, index, key, data, loop, future))
        try:
            async with asyncio.timeout(self.busy_timeout + _PART_DEADLINE):
                await future
        except TimeoutError:
            raise StoreError(f"writing a body part to {self.path} timed out") from None

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        # A body no row names is kept PART_GRACE past its newest part, and the row that
        # will name it comes next: the sweep never takes it meanwhile. Only check it.
        whole = await asyncio.to_thread(self._with_reader, _whole, parts.id, key, parts.length)
        if whole != parts:
            raise StoreError(f"a body streamed to {self.path} is not whole; not stored")

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        return await asyncio.to_thread(self._with_reader, _part, parts.id, key, index)

    def drop(self, key: str, body: int) -> None:
        if self._thread is not None:
            self._queue.put([body])

    def _with_reader(self, read: Callable[..., _T], *args: object) -> _T:
        """``read(conn, *args)`` on an idle part reader (opened if none is idle)."""
        with self._readers_lock:
            conn = self._readers.pop() if self._readers else None
        try:
            if conn is None:
                conn = self._connect_reader()
            found = read(conn, *args)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise StoreError(f"reading a body part from {self.path}: {exc}") from exc
        with self._readers_lock:
            if self._thread is not None:
                self._readers.append(conn)
                return found
        conn.close()  # the store closed meanwhile
        return found

    # -- the side file's writer thread -----------------------------------------------

    def _run(self, conn: sqlite3.Connection) -> None:
        swept = self.clock.monotonic()
        stopping = False
        kept = True  # the side file may hold blobs: sweep when idle
        try:
            while not stopping or not self._queue.empty():
                try:
                    if stopping:
                        item = self._queue.get_nowait()
                    elif kept:
                        item = self._queue.get(timeout=self.upkeep_after)
                    else:
                        item = self._queue.get()  # nothing to sweep until a body comes
                except queue.Empty:
                    kept = self._sweep(conn)
                    swept = self.clock.monotonic()
                    continue
                jobs: list[Job] = []
                drops: list[int] = []
                parts: list[_PartWrite] = []
                size = 0
                while True:
                    if item is None:
                        stopping = True
                    elif isinstance(item, list):
                        drops.extend(item)
                    elif isinstance(item, _PartWrite):
                        parts.append(item)
                        size += len(item.data)
                    else:
                        jobs.append(item)
                        size += sum(len(op.response.body) for op in item[0] if has_blob(op))
                    if size >= _COMMIT_BYTES:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if jobs or drops or parts:
                    self._write(conn, jobs, drops, parts)
                    kept = True
                if self.clock.monotonic() - swept >= self.upkeep_after:
                    kept = self._sweep(conn)
                    swept = self.clock.monotonic()
        finally:
            conn.close()
            if self._main is not None:
                self._main.close()
                self._main = None

    def _write(
        self,
        conn: sqlite3.Connection,
        jobs: list[Job],
        drops: list[int],
        parts: list[_PartWrite] | None = None,
    ) -> None:
        """Bodies and parts in one transaction, then each job on to the decision writer
        and each part's writer answered."""
        written: list[tuple[Job, list[tuple[Save, int]]]] = []
        error: BaseException | None = None
        parts = parts or []
        try:
            conn.execute("BEGIN IMMEDIATE")
            wall = self.clock.wall()
            if parts:
                conn.executemany(
                    "INSERT OR REPLACE INTO parts (blob, seq, key, written, body)"
                    " VALUES (?, ?, ?, ?, ?)",
                    [(p.blob, p.seq, p.key, wall, p.data) for p in parts],
                )
            for job in jobs:
                refs: list[tuple[Save, int]] = []
                for op in job[0]:
                    if has_blob(op):
                        blob = secrets.randbits(63) or 1
                        conn.execute(
                            "INSERT INTO blobs (id, key, written, body) VALUES (?, ?, ?, ?)",
                            (blob, op.key, wall, op.response.body),
                        )
                        refs.append((op, blob))
                written.append((job, refs))
            _delete(conn, drops)
            conn.execute("COMMIT")
        except Exception as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.error("porch: writing response bodies to %s failed: %s", self.path, exc)
            error = StoreError(f"SQLite store {self.path}: {exc}")
        for part in parts:
            part.reply(error)
        if error is not None:
            for ops, loop, done in jobs:
                # Nothing stored; the claims the saves were ending end all the same.
                instead = [Release(op.key, op.token) if has_blob(op) else op for op in ops]
                self._forward((instead, loop, _failed(done, error)))
            return
        for (ops, loop, done), refs in written:
            for op, blob in refs:
                self.placed[id(op)] = blob
            self._forward((ops, loop, self._replied(done, refs)))
        if drops:
            try:
                self._give_back(conn)
            except sqlite3.Error as exc:  # the pages stay free for the next bodies
                logger.warning("porch: giving pages of %s back failed: %s", self.path, exc)

    def _replied(
        self, done: Callable[[BaseException | None], None], refs: Sequence[tuple[Save, int]]
    ) -> Callable[[BaseException | None], None]:
        placed = self.placed

        def reply(error: BaseException | None) -> None:
            unused = [blob for op, blob in refs if error is not None or op.outcome != "saved"]
            for op, _ in refs:
                placed.pop(id(op), None)
            if unused and self._thread is not None:
                self._queue.put(unused)  # fenced, over quota or failed: no row names them
            done(error)

        return reply

    def _sweep(self, conn: sqlite3.Connection) -> bool:
        """Delete old blobs that no row names (orphans, expired or replaced responses);
        whether any blob is left (an idle thread with none sleeps until the next body)."""
        try:
            wall = self.clock.wall()
            old = [
                int(blob)
                for (blob,) in conn.execute(
                    "SELECT id FROM blobs WHERE written <= ?", (wall - ORPHAN_GRACE,)
                )
            ]
            # Bodies in parts whose newest part is old: an upload still going on writes
            # a part more often than that.
            stale = conn.execute(_STALE_PARTS, (wall - self.part_grace,))
            old += [int(blob) for (blob,) in stale]
            if old:
                named = self._named()
                gone = [blob for blob in old if blob not in named]
                if gone:
                    conn.execute("BEGIN IMMEDIATE")
                    _delete(conn, gone)
                    conn.execute("COMMIT")
            self._give_back(conn, idle=True)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # idle: the WAL goes to 0 bytes
            return conn.execute(_ANY_LEFT).fetchone()[0] is not None
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.warning("porch: sweeping %s failed: %s", self.path, exc)
            return True

    def _named(self) -> set[int]:
        main = self._main
        if main is None:
            main = self._main = sqlite3.connect(
                self.data, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
            )
        # Read after the blobs' list: a row committed since names a blob of the grace.
        return {int(b) for (b,) in main.execute(_NAMED)}

    def _give_back(self, conn: sqlite3.Connection, idle: bool = False) -> None:
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        # Busy, free pages are kept for the next bodies up to FREE_PAGES; idle, all go.
        pages = int(free) if idle else int(free) - FREE_PAGES
        if pages <= 0:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            give_back(conn, pages)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


_NAMED = "SELECT blob FROM responses WHERE blob IS NOT NULL"
_STALE_PARTS = (
    "SELECT DISTINCT blob FROM parts WHERE written <= ?1"
    " AND blob NOT IN (SELECT blob FROM parts WHERE written > ?1)"
)
_ANY_LEFT = "SELECT coalesce((SELECT 1 FROM blobs LIMIT 1), (SELECT 1 FROM parts LIMIT 1))"
_Item = Job | list[int] | _PartWrite | None
_T = TypeVar("_T")


def _whole(conn: sqlite3.Connection, blob: int, key: str, length: int) -> Parts | None:
    """The reference of ``key``'s body ``blob`` in parts if all of them are there and
    they hold ``length`` bytes; else None. (``length()`` reads no overflow page.)"""
    count, total, last = conn.execute(
        "SELECT count(*), coalesce(sum(length(body)), 0), max(seq) FROM parts"
        " WHERE blob = ? AND key = ?",
        (blob, key),
    ).fetchone()
    if count == 0 or last != count - 1 or total != length:
        return None
    return Parts(blob, int(count), int(total))


def _part(conn: sqlite3.Connection, blob: int, key: str, index: int) -> bytes | None:
    row = conn.execute(
        "SELECT body FROM parts WHERE blob = ? AND seq = ? AND key = ?", (blob, index, key)
    ).fetchone()
    return None if row is None else bytes(row[0])


def _delete(conn: sqlite3.Connection, blobs: Iterable[int]) -> None:
    """Delete these bodies, whole or in parts (one id space: random 63-bit ids)."""
    ids = list(blobs)
    for i in range(0, len(ids), _CHUNK):
        chunk = ids[i : i + _CHUNK]
        marks = ",".join("?" * len(chunk))
        conn.execute(f"DELETE FROM blobs WHERE id IN ({marks})", chunk)
        conn.execute(f"DELETE FROM parts WHERE blob IN ({marks})", chunk)


def _failed(
    done: Callable[[BaseException | None], None], error: BaseException
) -> Callable[[BaseException | None], None]:
    def reply(_: BaseException | None) -> None:
        done(error)

    return reply
