"""Counters in the writer's transaction: hits decided and settles applied, every algorithm.

A counter key is ``rl US rule US limit US <level key>``; its first three fields
(the prefix) are stored once in ``counter_names`` and a row of ``counts`` holds
the prefix's id, the rest (the client), and the state of docs/design.md
("Policies"): ``count`` (n), ``previous`` (p, sliding), ``algorithm`` (the tag)
and the times. ``window_start`` is a fixed or sliding window's start, and for
gcra the moment the row was written; ``expires`` is when the row may go (a
fixed window's end, a sliding window's second end, gcra's theoretical arrival
time); ``wall_start`` is the wall time at ``window_start``, for the rebase
after a reboot (schema.py), which keeps every algorithm's state that way.

Every key a batch names is read once and written once per transaction, however
many ops share it; in between the ops are applied in arrival order on the rows
in memory. A refused hit writes nothing, not even an elapsed window's roll.
Expired rows are read as absent (and overwritten in place by the next allowed
hit), and a bounded number of others are deleted per transaction.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from ...errors import StoreError
from ..algorithms import (
    FIXED,
    GCRA,
    TAGS,
    State,
    charge,
    expiry,
    fill_reports,
    fits,
    read,
    report,
)
from ..algorithms import settle as settled
from ..base import Hit, Settle, Vacate
from .saves import chunks
from .slots import SQLiteSlots

__all__ = ["apply_counters", "apply_lone_hit", "prune_counters", "split_key"]

_UPSERT_COUNTER = (
    "INSERT INTO counts"
    " (name, client, count, window_start, expires, wall_start, previous, algorithm)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (name, client) DO UPDATE SET count = excluded.count,"
    " window_start = excluded.window_start, expires = excluded.expires,"
    " wall_start = excluded.wall_start, previous = excluded.previous,"
    " algorithm = excluded.algorithm"
)
_UPDATE_COUNT = "UPDATE counts SET count = ? WHERE name = ? AND client = ?"
_SELECT_COUNTER = (
    "SELECT count, window_start, expires, algorithm FROM counts WHERE name = ? AND client = ?"
)
# Expired counters are read first and then deleted by their primary key. One
# ``DELETE ... WHERE (name, client) IN (SELECT ...)`` is planned by SQLite as a search
# on ``name`` alone, testing every row of that name (for one limit, every client):
# 35 ms to prune 64 expired rows among 200,000 live ones, on every transaction once
# windows expire, where these two statements take 0.5 ms.
_EXPIRED_COUNTERS = "SELECT name, client FROM counts WHERE expires <= ? ORDER BY expires LIMIT ?"
_DELETE_COUNTER = "DELETE FROM counts WHERE name = ? AND client = ?"
_US = "\x1f"

# A row in memory: [count, window_start, expires, wall_start, write, previous, algorithm].
# What a transaction must write for it: nothing, its count alone, or the whole row.
_CLEAN, _COUNT, _WINDOW = 0, 1, 2
# A one-limit hit's fits, shared (immutable): one allocation fewer per request.
_FITS, _REFUSED = (True,), (False,)


def split_key(key: str) -> tuple[str, str]:
    """``(prefix, client)`` of a counter key: its first three US-terminated fields (porch's
    ``rl US rule US limit US``, one per rule and limit) and the rest; ``("", key)`` for a
    key with fewer fields. The prefix is stored once, in ``counter_names``."""
    parts = key.split(_US, 3)
    if len(parts) < 4:
        return "", key
    client = parts[3]
    return key[: len(key) - len(client)], client


def prune_counters(conn: sqlite3.Connection, now: float, rows: int) -> None:
    """Delete up to ``rows`` expired counters, the longest expired first."""
    expired = conn.execute(_EXPIRED_COUNTERS, (now, rows)).fetchall()
    if expired:
        conn.executemany(_DELETE_COUNTER, expired)


def _name_ids(
    conn: sqlite3.Connection, prefixes: list[str], known: dict[str, int]
) -> dict[str, int]:
    """The id of each prefix, adding the new ones (a handful: one per rule and limit).

    ``known`` keeps the ids read from the table: a committed row of counter_names
    never changes or goes, so a busy store reads it once, not once per transaction.
    Ids inserted here are not kept: this transaction may still roll back.
    """
    ids = {prefix: known[prefix] for prefix in prefixes if prefix in known}
    if len(ids) == len(prefixes):
        return ids
    missing = [prefix for prefix in prefixes if prefix not in ids]
    for chunk in chunks(missing):
        marks = ",".join("?" * len(chunk))
        for prefix, name in conn.execute(
            f"SELECT prefix, id FROM counter_names WHERE prefix IN ({marks})", chunk
        ):
            ids[prefix] = known[prefix] = int(name)
    for prefix in missing:
        if prefix not in ids:
            cursor = conn.execute("INSERT INTO counter_names (prefix) VALUES (?)", (prefix,))
            ids[prefix] = int(cursor.lastrowid or 0)
    return ids


def apply_lone_hit(
    conn: sqlite3.Connection,
    hit: Hit,
    now: float,
    wall: float,
    known: dict[str, int],
    slots: SQLiteSlots | None = None,
) -> int:
    """A batch of one fixed-window hit on one limit (and any concurrency caps, ``slots``):
    apply_counters's rows and verdict, with one row read and at most one statement
    written; 1 if it created the row."""
    key = hit.keys[0]
    prefix, client = split_key(key)
    name = known.get(prefix)
    if name is None:
        name = _name_ids(conn, [prefix], known)[prefix]
    row = conn.execute(_SELECT_COUNTER, (name, client)).fetchone()
    amount = hit.amounts[0]
    window = hit.windows[0]
    cost = hit.cost
    fresh = row is None or row[3] != FIXED or now >= row[2] or now >= row[1] + window
    # A fresh window; an elapsed one (or another algorithm's row) is overwritten in place,
    # and only by an allowed hit.
    count, start = (0, now) if fresh else (row[0], row[1])
    fit = count + cost <= amount
    allowed = fit
    if hit.slots is not None:
        if slots is None:
            raise StoreError("this SQLite store takes no concurrency slots")
        if slots.count(conn, hit) and fit:
            slots.take(hit)
        else:
            allowed = False
    if allowed:
        count += cost
        if fresh:
            conn.execute(_UPSERT_COUNTER, (name, client, count, now, now + window, wall, 0, FIXED))
        else:
            conn.execute(_UPDATE_COUNT, (count, name, client))
    hit.allowed = allowed
    hit.fits = _FITS if fit else _REFUSED
    hit.remaining = [amount - count if count < amount else 0]
    # A fixed window's next, full and retry are all its end: one list, read only.
    hit.next = hit.full = hit.retry = [start + window - now]
    hit.stamp = [start]
    hit.wall = wall
    return 1 if row is None and allowed else 0


def _read_counters(
    conn: sqlite3.Connection, keys: set[str], known: dict[str, int]
) -> tuple[dict[str, list[Any]], dict[str, tuple[str, str]], dict[str, int]]:
    """The rows of ``keys`` (in memory, see _CLEAN), each key's (prefix, client), and
    the prefixes' ids."""
    rows: dict[str, list[Any]] = {}
    places: dict[str, tuple[str, str]] = {}
    clients: dict[str, dict[str, str]] = {}  # prefix -> client -> key
    for key in keys:
        prefix, client = places[key] = split_key(key)
        clients.setdefault(prefix, {})[client] = key
    names = _name_ids(conn, list(clients), known)
    for prefix, of_prefix in clients.items():
        name = names[prefix]
        for chunk in chunks(list(of_prefix)):
            marks = ",".join("?" * len(chunk))
            for client, count, start, expires, wall_start, previous, tag in conn.execute(
                "SELECT client, count, window_start, expires, wall_start, previous, algorithm"
                f" FROM counts WHERE name = ? AND client IN ({marks})",
                [name, *chunk],
            ):
                rows[of_prefix[client]] = [count, start, expires, wall_start, _CLEAN, previous, tag]
    return rows, places, names


def _write_counters(
    conn: sqlite3.Connection,
    rows: dict[str, list[Any]],
    places: dict[str, tuple[str, str]],
    names: dict[str, int],
) -> None:
    """Write each changed row once: in full, or its count alone."""
    whole: list[tuple[Any, ...]] = []
    counts: list[tuple[Any, ...]] = []
    for key, r in rows.items():
        if r[4] == _WINDOW:
            prefix, client = places[key]
            whole.append((names[prefix], client, r[0], r[1], r[2], r[3], r[5], r[6]))
        elif r[4] == _COUNT:
            prefix, client = places[key]
            counts.append((r[0], names[prefix], client))
    if whole:
        conn.executemany(_UPSERT_COUNTER, whole)
    if counts:
        # Within a window only the count changes: leaving the indexed expiry
        # column alone keeps the index pages out of the commit.
        conn.executemany(_UPDATE_COUNT, counts)


def _state(row: list[Any] | None, tag: int, now: float, window: float) -> State:
    """A key's state as an op at ``now`` reads it (absent, expired or another
    algorithm's row: fresh; an elapsed window rolled). Nothing is written."""
    if row is None or row[6] != tag or now >= row[2]:
        return 0, 0, now
    if tag == GCRA:
        return read(GCRA, 0, 0, row[2], now, window)
    return read(tag, row[0], row[5], row[1], now, window)


def _store(
    rows: dict[str, list[Any]],
    key: str,
    tag: int,
    state: State,
    window: float,
    now: float,
    wall: float,
) -> bool:
    """Keep ``state`` as the key's row, to be written; True if the key had no row."""
    n, p, s = state
    row = rows.get(key)
    if tag == GCRA:
        # window_start: when it was written (the rebase's anchor); expires: the TAT.
        rows[key] = [0, now, s, wall, _WINDOW, 0, GCRA]
    elif row is not None and row[6] == tag and row[1] == s and row[5] == p and now < row[2]:
        row[0] = n  # the same window: its count alone
        if row[4] == _CLEAN:
            row[4] = _COUNT
    else:
        rows[key] = [n, s, expiry(tag, s, window), wall - (now - s), _WINDOW, p, tag]
    return row is None


def apply_counters(
    conn: sqlite3.Connection,
    ops: list[Hit | Settle | Vacate],
    now: float,
    wall: float,
    known: dict[str, int],
    slots: SQLiteSlots | None = None,
) -> int:
    """Decide the hits and apply the settles and vacates in arrival order; how many rows
    were created.

    ``known``: counter-name ids this connection already read (see _name_ids).
    ``slots``: this store's concurrency slots (None: a hit with slots is refused).
    """
    keys = {key for op in ops if not isinstance(op, Vacate) for key in op.keys}
    rows, places, names = _read_counters(conn, keys, known)
    created = 0
    for op in ops:
        if isinstance(op, Settle):
            created += _settle(op, rows, now, wall)
            continue
        if isinstance(op, Vacate):
            if slots is not None:
                slots.vacate(op)
            continue
        hit = op
        cost = hit.cost
        if hit.algorithms is None and len(hit.keys) == 1:
            # One fixed window (the common rule; with a concurrency cap or not): no
            # per-limit lists to build.
            key = hit.keys[0]
            amount = hit.amounts[0]
            window = hit.windows[0]
            row = rows.get(key)
            stale = row is None or row[6] != FIXED or now >= row[2] or now >= row[1] + window
            allowed = (0 if stale or row is None else row[0]) + cost <= amount
            if hit.slots is not None:
                # Counted whatever the rate limit says (the headers report them); taken
                # only with the units: all or nothing.
                if slots is None:
                    raise StoreError("this SQLite store takes no concurrency slots")
                if slots.count(conn, hit) and allowed:
                    slots.take(hit)
                else:
                    allowed = False
            if stale or row is None:
                fresh: list[Any] = [0, now, now + window, wall, _WINDOW, 0, FIXED]
                if allowed:
                    if row is None:
                        created += 1
                    row = rows[key] = fresh
                    row[0] = cost
                else:
                    row = fresh
            elif allowed:
                row[0] += cost
                if row[4] == _CLEAN:
                    row[4] = _COUNT
            count = row[0]
            hit.allowed = allowed
            hit.fits = _FITS if count + (0 if allowed else cost) <= amount else _REFUSED
            hit.remaining = [amount - count if count < amount else 0]
            hit.next = hit.full = hit.retry = [row[1] + window - now]
            hit.stamp = [row[1]]
            hit.wall = wall
            continue
        if hit.slots is not None or len(hit.keys) != 1:
            created += _decide(hit, rows, now, wall, cost, conn, slots)
            continue
        # One limit of another algorithm: _decide's steps without per-limit lists.
        key, amount, window = hit.keys[0], hit.amounts[0], hit.windows[0]
        burst = amount if hit.bursts is None else hit.bursts[0]
        tag = FIXED if hit.algorithms is None else TAGS[hit.algorithms[0]]
        state = _state(rows.get(key), tag, now, window)
        allowed = fits(tag, state, now, cost, amount, window, burst)
        if allowed:
            state = charge(tag, state, cost, amount, window)
            created += _store(rows, key, tag, state, window, now, wall)
        remaining, until_more, until_full, until_fit, stamp = report(
            tag, state, now, cost, amount, window, burst
        )
        hit.allowed = allowed
        hit.fits = _FITS if allowed else _REFUSED
        hit.remaining = [remaining]
        hit.next = [until_more]
        hit.full = [until_full]
        hit.retry = [until_fit]
        hit.stamp = [stamp]
        hit.wall = wall
    _write_counters(conn, rows, places, names)
    return created


def _decide(
    hit: Hit,
    rows: dict[str, list[Any]],
    now: float,
    wall: float,
    cost: int,
    conn: sqlite3.Connection,
    slots: SQLiteSlots | None,
) -> int:
    """Decide a hit on any number of limits, and concurrency slots: every limit and
    every slot, or nothing. How many rows it created."""
    keys, amounts, windows = hit.keys, hit.amounts, hit.windows
    bursts = amounts if hit.bursts is None else hit.bursts
    algorithms = hit.algorithms
    tags = [FIXED] * len(keys) if algorithms is None else [TAGS[a] for a in algorithms]
    states = [
        _state(rows.get(key), tag, now, window)
        for key, tag, window in zip(keys, tags, windows, strict=True)
    ]
    fit = [
        fits(tag, state, now, cost, amount, window, burst)
        for tag, state, amount, window, burst in zip(
            tags, states, amounts, windows, bursts, strict=True
        )
    ]
    allowed = all(fit)
    if hit.slots is not None:
        # Counted whatever the rate limits say (the headers report them); taken only
        # with the units: all or nothing.
        if slots is None:
            raise StoreError("this SQLite store takes no concurrency slots")
        free = slots.count(conn, hit)
        allowed = allowed and free
        if allowed:
            slots.take(hit)
    created = 0
    if allowed:
        for j, key in enumerate(keys):
            states[j] = charge(tags[j], states[j], cost, amounts[j], windows[j])
            created += _store(rows, key, tags[j], states[j], windows[j], now, wall)
    reports = [
        report(tag, state, now, cost, amount, window, burst)
        for tag, state, amount, window, burst in zip(
            tags, states, amounts, windows, bursts, strict=True
        )
    ]
    hit.allowed = allowed
    hit.fits = fit
    fill_reports(hit, reports, wall)
    return created


def _settle(op: Settle, rows: dict[str, list[Any]], now: float, wall: float) -> int:
    """Charge or refund a settle's units (docs/design.md, "Policies": the settle rule);
    how many rows it created."""
    created = 0
    algorithms = op.algorithms
    for j, (key, amount, window, delta, stamp) in enumerate(
        zip(op.keys, op.amounts, op.windows, op.deltas, op.stamps, strict=True)
    ):
        tag = FIXED if algorithms is None else TAGS[algorithms[j]]
        state = settled(
            tag, _state(rows.get(key), tag, now, window), now, delta, stamp, amount, window
        )
        if state is not None:
            created += _store(rows, key, tag, state, window, now, wall)
    return created
