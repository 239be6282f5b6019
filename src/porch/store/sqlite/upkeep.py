"""Keeping the SQLite file small and the writer fair: what the writer thread does besides
applying batches.

- Idle upkeep: when no batch came for a while, one bounded transaction prunes
  expired responses and gives free pages back (``auto_vacuum = INCREMENTAL``),
  so space is reclaimed without waiting for new saves.
- Fair group commits: a batch that saves more than ``BIG_BATCH`` bytes of
  responses never holds up the small batches (decisions) queued with it, and
  big batches share a transaction only up to ``COMMIT_BYTES``.
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..base import Save, StoreOp
from .ops import prune_expired

__all__ = ["FREE_PAGES", "WAL_LIMIT", "FairBatches", "give_back", "upkeep"]

BIG_BATCH = 64 * 1024
COMMIT_BYTES = 1 << 20
WAL_LIMIT = 4 << 20
# Idle upkeep: expired rows pruned and free pages given back, this many per transaction.
UPKEEP_ROWS = 256
UPKEEP_PAGES = 256
# Free pages tolerated before a busy store gives some back between decisions.
FREE_PAGES = 1024

J = TypeVar("J")


def saved_bytes(ops: Sequence[StoreOp]) -> int:
    return sum(len(op.response.body) for op in ops if type(op) is Save)


class FairBatches(Generic[J]):
    """Orders the writer's jobs: small ones first, big saves at most COMMIT_BYTES a commit."""

    __slots__ = ("_big", "_ops")

    def __init__(self, ops: Callable[[J], Sequence[StoreOp]]) -> None:
        self._ops = ops
        self._big: collections.deque[tuple[J, int]] = collections.deque()

    def __bool__(self) -> bool:
        """Whether big jobs are still waiting for a transaction."""
        return bool(self._big)

    def next_transaction(self, arrived: list[J]) -> list[J]:
        """The jobs for the next transaction: every small one that arrived, then big ones
        up to the byte cap (at least one, so big saves always progress)."""
        jobs: list[J] = []
        for job in arrived:
            size = saved_bytes(self._ops(job))
            if size > BIG_BATCH:
                self._big.append((job, size))
            else:
                jobs.append(job)
        big = self._big
        budget = COMMIT_BYTES
        while big and (budget == COMMIT_BYTES or big[0][1] <= budget):
            job, size = big.popleft()
            jobs.append(job)
            budget -= size
        return jobs


def give_back(conn: sqlite3.Connection, pages: int) -> int:
    """Return up to ``pages`` free pages to the file system; how many there were."""
    (free,) = conn.execute("PRAGMA freelist_count").fetchone()
    n = int(min(free, pages))
    # The pragma frees one page per step, and Python's sqlite3 steps a statement without
    # result columns only once: one page per execute.
    for _ in range(n):
        conn.execute("PRAGMA incremental_vacuum(1)")
    return n


def upkeep(conn: sqlite3.Connection, now: Callable[[], float]) -> bool:
    """One bounded idle transaction: prune expired responses, give free pages back.

    ``now`` is read under the write lock. Returns whether there may be more to do
    (False: the writer can sleep until the next batch). Raises sqlite3.Error.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        pruned = prune_expired(conn, now(), UPKEEP_ROWS)
        freed = give_back(conn, UPKEEP_PAGES)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return pruned >= UPKEEP_ROWS or freed >= UPKEEP_PAGES
