"""Keeping the SQLite file small and the writer fair: what the writer thread does besides
applying batches.

- Idle upkeep: when no batch came for a while, one bounded transaction prunes
  expired responses and gives free pages back (``auto_vacuum = INCREMENTAL``),
  so space is reclaimed without waiting for new saves.
- Fair group commits: a batch that saves more than ``BIG_BATCH`` bytes of
  responses never holds up the small batches (decisions) queued with it, and
  big batches share a transaction only up to ``COMMIT_BYTES``.
- Checkpoints off the commit path: see :class:`Checkpoints`.
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..base import Save, StoreOp
from .ops import prune_expired

__all__ = [
    "FREE_PAGES",
    "HOLD_POLL",
    "STOP_WITHIN",
    "WAL_LIMIT",
    "Checkpoints",
    "FairBatches",
    "give_back",
    "join_within",
    "upkeep",
]

BIG_BATCH = 64 * 1024
COMMIT_BYTES = 1 << 20
# The data file's WAL. With many distinct clients each commit writes a page per new
# client; a longer WAL lets a checkpoint copy each page once for several of its frames
# (keys-1000000 at 64 connections: ~2 us less writer and checkpoint CPU a request than
# with 4 MiB). Big bodies live in the side file (blobs.py), whose WAL stays short.
WAL_LIMIT = 16 << 20
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

    def next_transaction(self, arrived: list[J], hold_big: bool = False) -> list[J]:
        """The jobs for the next transaction: every small one that arrived, then big ones
        up to the byte cap (at least one, so big saves always progress; none while
        ``hold_big``: a checkpoint is catching up, see Checkpoints)."""
        jobs: list[J] = []
        for job in arrived:
            size = saved_bytes(self._ops(job))
            if size > BIG_BATCH:
                self._big.append((job, size))
            else:
                jobs.append(job)
        big = self._big
        budget = COMMIT_BYTES
        while big and not hold_big and (budget == COMMIT_BYTES or big[0][1] <= budget):
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


# WAL checkpoints off the commit path (see Checkpoints): at most one background
# checkpoint per this many seconds while commits come (each round costs two fsyncs).
CHECKPOINT_PACE = 0.25
# ... unless the WAL is past half its limit and grew by this share of it since the last round.
FAST_GROWTH = 1 / 8
# The writer checkpoints by itself (SQLite's automatic checkpoint, inside a commit) once
# the WAL is this many times its limit: only when the thread was kept from its rounds.
BACKSTOP = 2
# While big saves are held for a checkpoint, an idle writer looks this often for its end.
HOLD_POLL = 0.002
# Closing waits this long for each of the store's threads to end (the work it has in hand:
# batches that may each wait busy_timeout for the file, a checkpoint and its fsyncs). Past
# it the thread, a daemon, is left to finish, with a warning: a close never hangs.
STOP_WITHIN = 30.0

logger = logging.getLogger("porch.store")


def join_within(thread: threading.Thread, within: float) -> None:
    """Wait for ``thread`` to end, ``within`` seconds at most (then say it was left)."""
    thread.join(within)
    if thread.is_alive():
        logger.warning(
            "porch: thread %s did not stop within %g s; left to finish", thread.name, within
        )


class Checkpoints:
    """Keeps the WAL near ``WAL_LIMIT`` without checkpoints on the commit path.

    SQLite's automatic checkpoint runs inside the COMMIT that takes the WAL past
    its limit: that commit copies every page in the WAL into the database file and
    waits for two fsyncs (the WAL's, then the file's), and every decision queued
    behind it waits too. With many distinct clients each commit adds a page per
    new client, so this came every few dozen commits. Here the writer connection
    checkpoints by itself only as a backstop (past ``BACKSTOP`` limits, below); a
    thread of its own, on its own connection, runs PASSIVE checkpoints (the copy and
    both fsyncs) while the writer goes on committing (sqlite3 releases the GIL
    meanwhile): at most every ``CHECKPOINT_PACE`` seconds while the WAL is short or
    grows slowly, back to back once it is past half its limit and a round's worth of
    commits added more than ``FAST_GROWTH`` of it. The WAL restarts from its start only when
    a write transaction begins after every frame was copied, which a busy writer
    never leaves the background time to reach; so once a background checkpoint
    saw more than ``WAL_LIMIT`` in the WAL, the writer copies the few frames added
    since, between two of its transactions: still PASSIVE, never waiting for a
    reader (``porch inspect``), so other processes' writers may delay the restart
    to the next round, as with SQLite's own checkpoints.

    That copy is short only if the background left little: with big saves
    coming, it is every megabyte saved during the last background round and an
    fsync, and every decision queued behind it waited that long (up to 170 ms
    measured). So first the writer holds big saves (``holding``; decisions still
    commit) while one more background round copies what the big saves wrote;
    then the writer copies only the decisions' few frames since, and lets the big
    saves go. A decision never waits for a big save's pages to be checkpointed.

    Commits on the event loop (one decision each, at low load) never catch up,
    and then the writer may have no transaction to do it in: the thread calls
    ``wake`` when it asks for a catch-up, and the writer runs one (empty)
    transaction to reach it.

    A thread kept from its rounds (a loaded machine) would let the WAL grow with
    every commit; past ``BACKSTOP`` limits SQLite's own checkpoint runs inside the
    writer's commits, as by default, so the WAL stays bounded, and decisions wait
    for that copy only then.
    """

    __slots__ = (
        "_catch_up",
        "_connect",
        "_drained",
        "_failed",
        "_hurry",
        "_limit",
        "_nudge",
        "_stopping",
        "_thread",
        "_wake",
        "holding",
    )

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        failed: Callable[[sqlite3.Error], None],
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._connect = connect
        self._wake = wake  # from the thread: the writer should run a transaction soon
        self._failed = failed  # called from either thread; must be thread-safe
        self._nudge = threading.Event()
        self._stopping = threading.Event()
        # Ends the thread's pace early: big saves are held, or the thread is stopping.
        self._hurry = threading.Event()
        self._catch_up = False
        # Big saves held for a background round (set and cleared by the writer); that
        # round done (set by the checkpoint thread).
        self.holding = False
        self._drained = False
        self._limit = WAL_LIMIT // 4096
        self._thread: threading.Thread | None = None

    def start(self, writer: sqlite3.Connection, name: str) -> None:
        """Open the thread's connection, turn the writer's own checkpoints off and start
        the thread. If that connection cannot be opened, the writer keeps SQLite's
        automatic checkpoints (raises nothing)."""
        try:
            conn = self._connect()
        except sqlite3.Error as exc:
            self._failed(exc)
            return
        (page_size,) = writer.execute("PRAGMA page_size").fetchone()
        self._limit = max(1, WAL_LIMIT // int(page_size))
        # A backstop, not the path: the thread keeps the WAL under about 1.5 limits, so
        # SQLite's own checkpoint on the commit path runs only when the thread falls a
        # limit behind (on a loaded machine the WAL once reached 4 limits without it).
        writer.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP * self._limit}")
        self._thread = threading.Thread(target=self._run, args=(conn,), name=name, daemon=True)
        self._thread.start()

    def committed(self, writer: sqlite3.Connection, catch_up: bool = True) -> None:
        """After each of the writer's transactions: wake the thread, hold big saves for
        it, or catch up once it copied what they wrote (not when ``catch_up`` is False:
        a commit on the event loop)."""
        if self._catch_up and catch_up:
            if not self.holding:
                self.holding, self._drained = True, False
                self._nudge.set()
                self._hurry.set()  # the WAL grows past its limit until that round ran
                return
            if not self._drained:
                return
            self._catch_up = self.holding = False
            try:
                writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:
                self._failed(exc)
        elif self._thread is not None and not self._nudge.is_set():
            self._nudge.set()

    def stop(self) -> None:
        """Stop the thread (before the writer closes: the last connection checkpoints)."""
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        self._stopping.set()
        self._nudge.set()
        self._hurry.set()
        join_within(thread, STOP_WITHIN)

    def _run(self, conn: sqlite3.Connection) -> None:
        last = 0  # frames in the WAL at the last round
        try:
            while not self._stopping.is_set():
                self._nudge.wait()
                self._nudge.clear()
                if self._stopping.is_set():
                    return
                held = self.holding  # big saves held since before this round began
                try:
                    _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:
                    self._failed(exc)
                    frames = self._limit
                grown, last = (frames - last if frames >= last else frames), frames
                if held:
                    self._drained = True
                elif frames >= self._limit and not self._catch_up:
                    self._catch_up = True
                    if self._wake is not None:
                        self._wake()
                if frames < self._limit // 2 or grown < self._limit * FAST_GROWTH:
                    # A short WAL can wait, and so can one a few frames a round longer
                    # (one decision per commit at low load: copying back to back, two
                    # fsyncs a round, cost ~30 us of CPU per request at one connection);
                    # a long and fast-growing one is copied back to back (its length is
                    # bounded by what the writer adds during one copy).
                    self._hurry.wait(CHECKPOINT_PACE)
                    self._hurry.clear()
        finally:
            self._drained = True  # never leave big saves held for a thread that is gone
            conn.close()
