"""The SQL of each store operation, applied inside the writer's transaction.

Each kind of operation is applied in bulk: one ``SELECT ... IN`` for every key
the batch reads, one ``executemany`` for every row it writes. Counters are
written through (one upsert per key per transaction, never delete-then-insert);
expired rows are pruned when touched, plus a bounded number of others per
transaction, so the tables stay bounded without a sweeper.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

from .base import Hit, Lookup, Save, StoredResponse, StoreOp

__all__ = ["apply_batch"]

_UPSERT_COUNTER = (
    "INSERT INTO counters (key, count, window_start, expires, wall_start) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET count = excluded.count,"
    " window_start = excluded.window_start, expires = excluded.expires,"
    " wall_start = excluded.wall_start"
)
_PRUNE_COUNTERS = (
    "DELETE FROM counters WHERE key IN"
    " (SELECT key FROM counters WHERE expires <= ? ORDER BY expires LIMIT ?)"
)
_PRUNE_RESPONSES = (
    "DELETE FROM responses WHERE key IN"
    " (SELECT key FROM responses WHERE expires <= ? ORDER BY expires LIMIT ?)"
)
_SELECT_RESPONSE = "SELECT digest, status, headers, body, expires FROM responses WHERE key = ?"
_UPSERT_RESPONSE = (
    "INSERT INTO responses (key, digest, status, headers, body, stored_at, expires, stored_wall)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET digest = excluded.digest, status = excluded.status,"
    " headers = excluded.headers, body = excluded.body, stored_at = excluded.stored_at,"
    " expires = excluded.expires, stored_wall = excluded.stored_wall"
)
_SELECT_CHUNK = 256  # keys per SELECT ... IN (...), below SQLite's variable limit


def _chunks(keys: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(keys), _SELECT_CHUNK):
        yield keys[i : i + _SELECT_CHUNK]


def apply_batch(
    conn: sqlite3.Connection, ops: Sequence[StoreOp], now: float, wall: float, prune: int
) -> None:
    """Apply ``ops`` with the clock read once for the whole transaction."""
    hits: list[Hit] = []
    lookups: list[Lookup] = []
    saves: list[Save] = []
    for op in ops:
        if type(op) is Hit:
            hits.append(op)
        elif type(op) is Lookup:
            lookups.append(op)
        elif type(op) is Save:
            saves.append(op)
    if lookups and saves and {op.key for op in lookups} & {op.key for op in saves}:
        # A key both read and written in one batch: keep arrival order exactly.
        for op in ops:
            if type(op) is Lookup:
                _apply_lookups(conn, [op], now)
            elif type(op) is Save:
                _apply_saves(conn, [op], now, wall)
    else:
        if lookups:
            _apply_lookups(conn, lookups, now)
        if saves:
            _apply_saves(conn, saves, now, wall)
    if saves:
        conn.execute(_PRUNE_RESPONSES, (now, max(prune, 2 * len(saves))))
    if hits:
        created = _apply_hits(conn, hits, now, wall)
        conn.execute(_PRUNE_COUNTERS, (now, max(prune, 2 * created)))


def _apply_lookups(conn: sqlite3.Connection, lookups: list[Lookup], now: float) -> None:
    found: dict[str, StoredResponse | None] = {}
    expired: list[tuple[str]] = []
    for chunk in _chunks(list({op.key for op in lookups})):
        marks = ",".join("?" * len(chunk))
        for key, digest, status, headers, body, expires in conn.execute(
            "SELECT key, digest, status, headers, body, expires FROM responses"
            f" WHERE key IN ({marks})",
            chunk,
        ):
            if now >= expires:
                expired.append((key,))  # pruned when touched
                found[key] = None
                continue
            found[key] = StoredResponse(
                bytes(digest),
                int(status),
                tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(headers)),
                bytes(body),
            )
    if expired:
        conn.executemany("DELETE FROM responses WHERE key = ?", expired)
    for op in lookups:
        op.result = found.get(op.key)


def _apply_saves(conn: sqlite3.Connection, saves: list[Save], now: float, wall: float) -> None:
    conn.executemany(
        _UPSERT_RESPONSE,
        [
            (
                op.key,
                op.response.digest,
                op.response.status,
                json.dumps(
                    [(k.decode("latin-1"), v.decode("latin-1")) for k, v in op.response.headers]
                ),
                op.response.body,
                now,
                now + op.ttl,
                wall,
            )
            for op in saves
        ],
    )


# What a transaction must write for a counter row.
_CLEAN, _COUNT, _WINDOW = 0, 1, 2


def _apply_hits(conn: sqlite3.Connection, hits: list[Hit], now: float, wall: float) -> int:
    # key -> [count, window_start, expires, wall_start, write]; read once per
    # transaction, written once per transaction, however many hits share a key.
    rows: dict[str, list[Any]] = {}
    for chunk in _chunks(list({key for hit in hits for key in hit.keys})):
        marks = ",".join("?" * len(chunk))
        for key, count, start, expires, wall_start in conn.execute(
            "SELECT key, count, window_start, expires, wall_start FROM counters"
            f" WHERE key IN ({marks})",
            chunk,
        ):
            rows[key] = [count, start, expires, wall_start, _CLEAN]
    created = 0
    for hit in hits:
        current: list[list[Any]] = []
        allowed = True
        for key, amount, window in zip(hit.keys, hit.amounts, hit.windows, strict=True):
            row = rows.get(key)
            if row is None or now >= row[2]:
                # A fresh window, or an elapsed one overwritten in place (the
                # expired row is pruned on this access, never deleted+inserted).
                if row is None:
                    created += 1
                row = [0, now, now + window, wall, _WINDOW]
                rows[key] = row
            if row[0] >= amount:
                allowed = False
            current.append(row)
        if allowed:
            for row in current:
                row[0] += 1
                if row[4] == _CLEAN:
                    row[4] = _COUNT
        hit.allowed = allowed
        hit.counts = [row[0] for row in current]
        hit.resets = [row[2] - now for row in current]
        hit.wall = wall
    windows = [(key, r[0], r[1], r[2], r[3]) for key, r in rows.items() if r[4] == _WINDOW]
    counts = [(r[0], key) for key, r in rows.items() if r[4] == _COUNT]
    if windows:
        conn.executemany(_UPSERT_COUNTER, windows)
    if counts:
        # Within a window only the count changes: leaving the indexed expiry
        # column alone keeps the index pages out of the commit.
        conn.executemany("UPDATE counters SET count = ? WHERE key = ?", counts)
    return created
