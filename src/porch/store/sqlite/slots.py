"""Concurrency slots of the SQLite store: a row per key and holder, a holder's life an OFD lock.

A row of ``slots`` says how many requests of one key one *holder* has in
flight: ``(key, holder, count)``. A holder is one open store in one process:
it locks one byte of the lock file (``2**62`` + its random 61-bit id, above
every claim's byte) when it first takes a slot, and the kernel drops that lock
when the file is closed — by ``close()``, or by the process's death, ``kill -9``
included. A hit counts a key's requests in flight as this holder's own count
(kept here, in memory) plus the rows of the other holders whose byte is still
locked (``F_OFD_GETLK``); the rows of a holder found dead are deleted there and
then. So a killed process's slots are free at once: no lease to wait out.

Everything here runs inside the writer's transaction, under SQLite's write
lock, which every process takes: a decision over a key's count is exact across
processes. This holder's own rows are written at the end of the transaction,
once per key, from the counts in memory; a transaction that rolls back undoes
what it took and freed in memory too. A vacate is never lost, though: one
whose transaction failed for good (not retried) is applied again here by
:meth:`keep`, and its rows are written by the next transaction or, if none
comes, by the writer when it is idle.

Without OFD locks (not Linux) nothing is written: slots are per process.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence

from ..base import Hit, StoreOp, Vacate
from .claims import KeyLocks

__all__ = ["SQLiteSlots"]

logger = logging.getLogger("porch.store")

_SELECT = "SELECT holder, count FROM slots WHERE key = ?"
_UPSERT = (
    "INSERT INTO slots (key, holder, count) VALUES (?, ?, ?)"
    " ON CONFLICT (key, holder) DO UPDATE SET count = excluded.count"
)
_DELETE = "DELETE FROM slots WHERE key = ? AND holder = ?"
_DELETE_HOLDER = "DELETE FROM slots WHERE holder = ?"


class SQLiteSlots:
    """This store's slots: its holder, its counts per key, and what a transaction changed.

    Used from whoever holds the writer's connection (the writer thread, or the event
    loop committing inline), one transaction at a time.
    """

    __slots__ = (
        "_alive",
        "_dirty",
        "_foreign",
        "_freed",
        "_holder",
        "_mine",
        "_opened",
        "_serial",
        "_taken",
        "_tokens",
        "locks",
    )

    def __init__(self, locks: KeyLocks | None) -> None:
        self.locks = locks
        self._holder = 0  # this open's holder id; 0 until the first slot
        self._opened = 0  # the lock file's descriptor the holder's lock is on (KeyLocks.opened)
        self._mine: dict[str, int] = {}  # key -> slots this holder has taken, not vacated
        self._dirty: set[str] = set()  # keys whose row is not yet what _mine says
        # The tokens of the hits holding slots here (a hit's own: a second vacate of it,
        # or one of a hit an earlier holder allowed, frees nothing).
        self._tokens: set[int] = set()
        self._serial = 0
        # Per hit: the slots taken by the transaction under way, and those it freed.
        self._taken: list[tuple[int, Sequence[str]]] = []
        self._freed: list[tuple[int, Sequence[str]]] = []
        # Per transaction: live slots of other holders per key, and the holders looked at.
        self._foreign: dict[str, int] = {}
        self._alive: dict[int, bool] = {}

    def _take_holder(self) -> int:
        """A holder id for this open, its lock taken (at the first slot)."""
        locks = self.locks
        if locks is None:
            self._holder = 1  # per process: no lock, no rows
        else:
            self._holder = locks.take_holder()
            self._opened = locks.opened
        return self._holder

    def begin(self) -> None:
        """A transaction starts: other holders' rows may have changed since the last, and
        this holder's lock may be gone (the lock file was closed, or this is a forked
        child: the descriptor is not the one the lock was taken on), and its slots with it."""
        self._foreign.clear()
        self._alive.clear()
        locks = self.locks
        if self._holder and locks is not None:
            locks.file()  # opens a descriptor of its own in a forked child
            if self._opened != locks.opened:
                self.close()

    def pending(self) -> bool:
        """Whether rows wait to be written (a transaction that freed slots rolled back)."""
        return bool(self._dirty)

    # -- inside the transaction ---------------------------------------------------------

    def count(self, conn: sqlite3.Connection, hit: Hit) -> bool:
        """Fill ``hit.in_flight`` (as things stand, without this hit); whether a free slot
        waits under every one of its keys."""
        slots = hit.slots or ()
        if len(slots) == 1:  # one cap (the common rule): no comprehensions
            n = self._count(conn, slots[0])
            hit.in_flight = [n]
            return n < hit.caps[0]
        in_flight = [self._count(conn, key) for key in slots]
        hit.in_flight = in_flight
        return all(n < cap for n, cap in zip(in_flight, hit.caps, strict=True))

    def take(self, hit: Hit) -> None:
        """Take one slot of each of the hit's keys (:meth:`count` said they are free)."""
        if not self._holder:
            self._take_holder()
        self._serial += 1
        token = self._serial
        self._tokens.add(token)
        mine = self._mine
        dirty = self._dirty
        slots = hit.slots or ()
        for key in slots:
            mine[key] = mine.get(key, 0) + 1
            dirty.add(key)
        self._taken.append((token, slots))
        hit.in_flight = [n + 1 for n in hit.in_flight]
        hit.token = token

    def vacate(self, op: Vacate) -> None:
        """Free the slots of a hit this holder allowed, once (none if they went with an
        earlier holder)."""
        token = op.token
        if token not in self._tokens:
            return
        self._tokens.discard(token)
        mine = self._mine
        for key in op.slots:
            held = mine.get(key, 0)
            if held > 1:
                mine[key] = held - 1
            else:
                mine.pop(key, None)
            self._dirty.add(key)
        self._freed.append((token, op.slots))

    def keep(self, ops: Sequence[StoreOp]) -> None:
        """The transaction of ``ops`` failed and is not retried: their vacates stand all the
        same (written by the next transaction), so a slot is never held by mistake."""
        for op in ops:
            if type(op) is Vacate:
                self.vacate(op)
        self._freed.clear()

    def write(self, conn: sqlite3.Connection) -> None:
        """Write this holder's changed rows (at the end of the transaction)."""
        dirty = self._dirty
        if not dirty or self.locks is None:
            dirty.clear()
            return
        holder, mine = self._holder, self._mine
        ups = [(key, holder, mine[key]) for key in dirty if key in mine]
        gone = [(key, holder) for key in dirty if key not in mine]
        if ups:
            conn.executemany(_UPSERT, ups)
        if gone:
            conn.executemany(_DELETE, gone)

    def committed(self) -> None:
        self._taken.clear()
        self._freed.clear()
        self._dirty.clear()

    def rolled_back(self) -> None:
        """The transaction rolled back: it took and freed nothing (the rows are as they were;
        the keys stay dirty, so the next transaction writes them whatever they hold)."""
        mine = self._mine
        for token, keys in self._taken:
            for key in keys:
                held = mine.get(key, 0)
                if held > 1:
                    mine[key] = held - 1
                else:
                    mine.pop(key, None)
            self._tokens.discard(token)
        for token, keys in self._freed:
            for key in keys:
                mine[key] = mine.get(key, 0) + 1
            self._tokens.add(token)
        self._taken.clear()
        self._freed.clear()

    def _count(self, conn: sqlite3.Connection, key: str) -> int:
        own = self._mine.get(key, 0)
        locks = self.locks
        if locks is None:
            return own
        foreign = self._foreign.get(key)
        if foreign is None:
            foreign = 0
            for holder, count in conn.execute(_SELECT, (key,)).fetchall():
                if holder != self._holder and self._lives(conn, locks, holder):
                    foreign += count
            self._foreign[key] = foreign
        return own + foreign

    def _lives(self, conn: sqlite3.Connection, locks: KeyLocks, holder: int) -> bool:
        alive = self._alive.get(holder)
        if alive is None:
            try:
                alive = locks.holder_alive(holder)
            except OSError as exc:  # counted as alive: never more in flight than the cap
                logger.error("porch: cannot tell whether a slot holder lives: %s", exc)
                alive = True
            self._alive[holder] = alive
            if not alive:
                # Its process died (or closed the store): every slot it held is free.
                conn.execute(_DELETE_HOLDER, (holder,))
        return alive

    def close(self) -> None:
        """The lock file is being closed: the holder and its slots go with it."""
        self._holder = 0
        self._mine.clear()
        self._tokens.clear()
        self._dirty.clear()
        self._taken.clear()
        self._freed.clear()
