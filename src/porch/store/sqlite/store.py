"""The embedded default store: one SQLite file in WAL mode, written by one thread
(bodies above 64 KiB in a side file with a writer thread of its own, see blobs.py).

The store is the public surface: settings, lifecycle, claims and slots, the operator's
view. It holds its parts: the writer (writer.py: the thread, its group commits and the
small batches committed on the loop), the side file of big bodies (blobs.py), the
claims' and slots' locks (claims.py, slots.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sqlite3
import tempfile
import time
import weakref
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._futures import resolve
from ...clock import Clock, SystemClock
from ...errors import ConfigurationError, StoreError
from ..base import (
    ALGORITHMS,
    PART_GRACE,
    Capabilities,
    Claims,
    Durability,
    StoreOp,
    StoreStatistics,
)
from .blobs import Blobs
from .claims import SQLiteClaims, ofd_locks_available
from .saves import BLOB_ABOVE
from .slots import SQLiteSlots
from .upkeep import STOP_WITHIN
from .writer import Done, Job, SQLiteWriter

if TYPE_CHECKING:
    from .admin import SQLiteAdmin

__all__ = ["SQLiteStore"]

logger = logging.getLogger("porch.store")

# How long close() at interpreter exit waits for the writer to finish its last batch.
_EXIT_JOIN = 10.0
# When the WAL is left after closing, another process had the file open: asked again after
# these pauses, in case it was closing at the same moment (see _last_out).
_LAST_OUT_PAUSES = (0.025, 0.05, 0.1)


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
        # Idempotency owners of every process sharing this file lock keys here.
        self._claims = SQLiteClaims(self.path.with_name(self.path.name + ".locks"))
        self.claims: Claims = self._claims
        # Concurrency slots: rows named by this store's holder, whose lock is in that file.
        self._slots = SQLiteSlots(self._claims.locks)
        # Bodies above 64 KiB: written by a thread of their own before their rows, which
        # it then hands to the writer.
        self._blobs = Blobs(
            self.path,
            durability=durability,
            busy_timeout=busy_timeout,
            clock=self.clock,
            upkeep_after=self.upkeep_after,
            forward=self._forward,
            part_grace=float(part_grace),
        )
        self._writer = SQLiteWriter(
            self.path,
            durability=durability,
            busy_timeout=busy_timeout,
            prune_batch=prune_batch,
            upkeep_after=self.upkeep_after,
            clock=self.clock,
            claims=self._claims,
            slots=self._slots,
            bodies=self._blobs,
        )
        self.capabilities = Capabilities(
            # One shard, one batch at a time: the one writer thread commits every queued
            # batch in one transaction anyway, so more would only split a loop
            # iteration's requests into more batches, hand-offs and wake-ups.
            shards=1,
            in_flight=1,
            clock=self.clock,
            # The writer's own methods: the pool calls them with no hop through the store.
            apply_then=self._writer.apply_then,
            apply_now=self._writer.apply_now if durability == "process" else None,
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
        secret = self._writer.secret
        if secret is None:
            raise StoreError(f"the SQLite store {self.path} is not open")
        return secret

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
        if self._writer.running:
            return
        if not ofd_locks_available():
            logger.info(
                "porch: no open-file-description locks on this platform; idempotency "
                "ownership is per process (counters stay exact across processes)"
            )
        try:
            await self._writer.start()
            # After the data file (its directory made, its schema migrated).
            await asyncio.to_thread(self._blobs.open)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if not self._writer.stop():
            return
        try:
            # Bodies first: the side file's writer hands what it wrote on to the writer.
            await asyncio.to_thread(self._blobs.close)
            # Its queued batches, each waiting busy_timeout at most for the file, then the
            # last checkpoint: bounded, never waited on forever (see STOP_WITHIN).
            await asyncio.to_thread(self._writer.join, self.busy_timeout + STOP_WITHIN)
        except RuntimeError:
            # At interpreter exit (an atexit handler closing the pool) the default executor
            # takes no more work: wait here, so the writer still closes its connection
            # (and SQLite removes the WAL) before the process ends.
            self._blobs.close(_EXIT_JOIN)
            self._writer.join(_EXIT_JOIN)
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
        return self._writer.statistics()

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        # Resolved on the caller's loop (the pool may have moved to another loop).
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writer.apply_then(ops, partial(resolve, future))
        await future

    def apply_then(self, ops: Sequence[StoreOp], done: Done) -> None:
        """Apply ``ops`` in one transaction; then ``done(None)`` (or ``done(error)``) on
        the calling loop. Small batches of hits commit on the loop when the writer is
        idle: see :meth:`.writer.SQLiteWriter.apply_then`."""
        self._writer.apply_then(ops, done)

    def apply_now(self, ops: Sequence[StoreOp]) -> bool:
        """Commit ``ops`` on the calling thread now, if that is cheap: True once committed;
        False if nothing was applied (see :meth:`.writer.SQLiteWriter.apply_now`)."""
        return self._writer.apply_now(ops)

    def _forward(self, job: Job) -> None:
        """From the side file's thread: a batch whose bodies committed, for the writer."""
        self._writer.submit(job)


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
