"""The SQL of each store operation, applied inside the writer's transaction.

Each kind of operation is applied in bulk: one ``SELECT ... IN`` for every key
the batch reads, one ``executemany`` for every row it writes. Counters are
written through (one upsert per key per transaction, never delete-then-insert);
expired rows are pruned when touched, plus a bounded number of others per
transaction, so the tables stay bounded without a sweeper. Claims take the
key's OFD lock (see :mod:`.claims`) before they read; the caller unlocks what a
rolled-back transaction took.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ..base import Claim, Hit, Lookup, Release, Save, StoredResponse, StoreOp
from .claims import SQLiteClaims
from .saves import Bodies, Heads, apply_writes, chunks

__all__ = ["apply_batch", "prune_expired", "split_key"]


_UPSERT_COUNTER = (
    "INSERT INTO counts (name, client, count, window_start, expires, wall_start)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (name, client) DO UPDATE SET count = excluded.count,"
    " window_start = excluded.window_start, expires = excluded.expires,"
    " wall_start = excluded.wall_start"
)
# Expired counters are read first and then deleted by their primary key. One
# ``DELETE ... WHERE (name, client) IN (SELECT ...)`` is planned by SQLite as a search
# on ``name`` alone, testing every row of that name (for one limit, every client):
# 35 ms to prune 64 expired rows among 200,000 live ones, on every transaction once
# windows expire, where these two statements take 0.5 ms.
_EXPIRED_COUNTERS = "SELECT name, client FROM counts WHERE expires <= ? ORDER BY expires LIMIT ?"
_DELETE_COUNTER = "DELETE FROM counts WHERE name = ? AND client = ?"
_PRUNE_RESPONSES = (
    "DELETE FROM responses WHERE key IN"
    " (SELECT key FROM responses WHERE expires <= ? ORDER BY expires LIMIT ?)"
)
# Whether each table has an expired row: min() of an indexed column is one index probe
# (NULL, so not true, for an empty table).
_ANY_EXPIRED = (
    "SELECT (SELECT min(expires) FROM responses) <= ?1, (SELECT min(expires) FROM counts) <= ?1"
)
# The claim epoch (the row was named when it held a plain counter; schema 3 created it).
_SELECT_EPOCH = "SELECT value FROM porch_meta WHERE name = 'claim_token'"
_UPDATE_EPOCH = "UPDATE porch_meta SET value = ? WHERE name = 'claim_token'"
_US = "\x1f"


def apply_batch(
    conn: sqlite3.Connection,
    ops: Sequence[StoreOp],
    now: float,
    wall: float,
    prune: int,
    claims: SQLiteClaims,
    names: dict[str, int] | None = None,
    bodies: Bodies | None = None,
    heads: Heads | None = None,
) -> None:
    """Apply ``ops`` with the clock read once for the whole transaction.

    ``names``: counter-name ids this connection already read (see _name_ids).
    ``bodies``: the side file of big bodies (None: every body is in the row).
    ``heads``: the stored forms of recent response heads (see headers_json).
    """
    if len(ops) == 1:
        op = ops[0]
        if type(op) is Hit and len(op.keys) == 1:
            # The uncontended request's batch (see KeyPool.apply_now): the same rows and
            # verdict as _apply_hits, without its per-batch sets, dicts and SQL text.
            created = _apply_lone_hit(conn, op, now, wall, {} if names is None else names)
            # The same prunes, each run only when the index shows it has a row to
            # delete: one two-probe statement instead of two DELETEs that find nothing.
            responses, counts = conn.execute(_ANY_EXPIRED, (now,)).fetchone()
            if responses:
                conn.execute(_PRUNE_RESPONSES, (now, prune))
            if counts:
                _prune_counters(conn, now, max(prune, 2 * created))
            return
    hits: list[Hit] = []
    reads: list[Claim | Lookup] = []
    writes: list[Save | Release] = []
    for op in ops:
        if type(op) is Hit:
            hits.append(op)
        elif type(op) is Claim or type(op) is Lookup:
            reads.append(op)
        elif type(op) is Save or type(op) is Release:
            writes.append(op)
    if reads and writes and {op.key for op in reads} & {op.key for op in writes}:
        # A key both read and written in one batch: keep arrival order exactly.
        for op in ops:
            if type(op) is Claim or type(op) is Lookup:
                _apply_reads(conn, [op], now, claims, bodies)
            elif type(op) is Save or type(op) is Release:
                apply_writes(conn, [op], now, wall, claims, bodies, heads)
    else:
        if reads:
            _apply_reads(conn, reads, now, claims, bodies)
        if writes:
            apply_writes(conn, writes, now, wall, claims, bodies, heads)
    # Every transaction, not only saves: a store that only answers lookups and hits
    # must still give back what expired. Bounded, and an index probe when nothing did.
    conn.execute(_PRUNE_RESPONSES, (now, max(prune, 2 * len(writes))))
    if hits:
        created = _apply_hits(conn, hits, now, wall, {} if names is None else names)
        _prune_counters(conn, now, max(prune, 2 * created))


def prune_expired(conn: sqlite3.Connection, now: float, rows: int) -> int:
    """Delete up to ``rows`` expired responses; how many went. (Counters are a few dozen
    bytes each and pruned by the hits that come; responses are what fill a disk.)"""
    return int(conn.execute(_PRUNE_RESPONSES, (now, rows)).rowcount)


def _prune_counters(conn: sqlite3.Connection, now: float, rows: int) -> None:
    """Delete up to ``rows`` expired counters, the longest expired first."""
    expired = conn.execute(_EXPIRED_COUNTERS, (now, rows)).fetchall()
    if expired:
        conn.executemany(_DELETE_COUNTER, expired)


def _apply_reads(
    conn: sqlite3.Connection,
    reads: list[Claim | Lookup],
    now: float,
    claims: SQLiteClaims,
    bodies: Bodies | None,
) -> None:
    keys: list[str] = []
    for op in reads:
        if type(op) is Claim and not claims.take(op.key):
            op.held = True  # an OFD lock dies with its holder: no lease to wait out
            continue
        keys.append(op.key)
    found = _select_responses(conn, keys, now, bodies) if keys else {}
    claimed: list[Claim] = []
    for op in reads:
        if type(op) is Lookup:
            op.result = found.get(op.key)
        elif type(op) is Claim and not op.held:
            stored = found.get(op.key)
            if stored is not None:
                op.stored = stored
                claims.end(op.key)  # nothing to own: answered from the store
            else:
                claimed.append(op)
    if claimed:
        first = _next_tokens(conn, len(claimed), claims)
        for i, op in enumerate(claimed):
            op.token = first + i
            claims.grant(op.key, op.token)


def _next_tokens(conn: sqlite3.Connection, count: int, claims: SQLiteClaims) -> int:
    """Reserve ``count`` fence tokens; the first. Strictly increasing for the file, across
    processes: the epoch is read (and, when another store claimed since, written) under
    the transaction's write lock (see SQLiteClaims.tokens)."""
    (epoch,) = conn.execute(_SELECT_EPOCH).fetchone()
    first, new = claims.tokens(int(epoch), count)
    if new is not None:
        conn.execute(_UPDATE_EPOCH, (str(new),))
    return first


def _select_responses(
    conn: sqlite3.Connection, keys: list[str], now: float, bodies: Bodies | None
) -> dict[str, StoredResponse]:
    found: dict[str, StoredResponse] = {}
    expired: list[tuple[str]] = []
    for chunk in chunks(list(set(keys))):
        marks = ",".join("?" * len(chunk))
        for key, digest, status, headers, body, expires, blob in conn.execute(
            "SELECT key, digest, status, headers, body, expires, blob FROM responses"
            f" WHERE key IN ({marks})",
            chunk,
        ):
            if now >= expires:
                expired.append((key,))  # pruned when touched
                continue
            if blob is not None:
                body = None if bodies is None else bodies.read(int(blob), key)
                if body is None:
                    # The side file lost it (a power loss under durability="process"):
                    # no stored response, so the key is served again.
                    expired.append((key,))
                    continue
            found[key] = StoredResponse(
                bytes(digest),
                int(status),
                tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(headers)),
                bytes(body),
            )
    if expired:
        conn.executemany("DELETE FROM responses WHERE key = ?", expired)
    return found


# What a transaction must write for a counter row.
_CLEAN, _COUNT, _WINDOW = 0, 1, 2


def split_key(key: str) -> tuple[str, str]:
    """``(prefix, client)`` of a counter key: its first three US-terminated fields (porch's
    ``rl US rule US limit US``, one per rule and limit) and the rest; ``("", key)`` for a
    key with fewer fields. The prefix is stored once, in ``counter_names``."""
    parts = key.split(_US, 3)
    if len(parts) < 4:
        return "", key
    client = parts[3]
    return key[: len(key) - len(client)], client


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


_SELECT_COUNTER = "SELECT count, expires FROM counts WHERE name = ? AND client = ?"
_UPDATE_COUNT = "UPDATE counts SET count = ? WHERE name = ? AND client = ?"


def _apply_lone_hit(
    conn: sqlite3.Connection, hit: Hit, now: float, wall: float, known: dict[str, int]
) -> int:
    """A batch of one hit on one limit: _apply_hits's rows and verdict, with one row read
    and at most one statement written; 1 if it created the row, else 0."""
    key = hit.keys[0]
    prefix, client = split_key(key)
    name = known.get(prefix)
    if name is None:
        name = _name_ids(conn, [prefix], known)[prefix]
    row = conn.execute(_SELECT_COUNTER, (name, client)).fetchone()
    if row is None or now >= row[1]:
        # A fresh window, or an elapsed one overwritten in place (as in _apply_hits).
        allowed = hit.amounts[0] > 0
        count, expires = int(allowed), now + hit.windows[0]
        conn.execute(_UPSERT_COUNTER, (name, client, count, now, expires, wall))
    else:
        count, expires = row
        allowed = count < hit.amounts[0]
        if allowed:
            count += 1
            conn.execute(_UPDATE_COUNT, (count, name, client))
    hit.allowed = allowed
    hit.counts = [count]
    hit.resets = [expires - now]
    hit.wall = wall
    return 1 if row is None else 0


def _apply_hits(
    conn: sqlite3.Connection, hits: list[Hit], now: float, wall: float, known: dict[str, int]
) -> int:
    # key -> [count, window_start, expires, wall_start, write, name, client]; read once
    # per transaction, written once per transaction, however many hits share a key.
    rows: dict[str, list[Any]] = {}
    places: dict[str, tuple[str, str]] = {}
    clients: dict[str, dict[str, str]] = {}  # prefix -> client -> key
    for key in {key for hit in hits for key in hit.keys}:
        prefix, client = places[key] = split_key(key)
        clients.setdefault(prefix, {})[client] = key
    names = _name_ids(conn, list(clients), known)
    for prefix, keys in clients.items():
        name = names[prefix]
        for chunk in chunks(list(keys)):
            marks = ",".join("?" * len(chunk))
            for client, count, start, expires, wall_start in conn.execute(
                "SELECT client, count, window_start, expires, wall_start FROM counts"
                f" WHERE name = ? AND client IN ({marks})",
                [name, *chunk],
            ):
                rows[keys[client]] = [count, start, expires, wall_start, _CLEAN]
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
    windows: list[tuple[Any, ...]] = []
    counts: list[tuple[Any, ...]] = []
    for key, r in rows.items():
        if r[4] == _WINDOW:
            prefix, client = places[key]
            windows.append((names[prefix], client, r[0], r[1], r[2], r[3]))
        elif r[4] == _COUNT:
            prefix, client = places[key]
            counts.append((r[0], names[prefix], client))
    if windows:
        conn.executemany(_UPSERT_COUNTER, windows)
    if counts:
        # Within a window only the count changes: leaving the indexed expiry
        # column alone keeps the index pages out of the commit.
        conn.executemany(_UPDATE_COUNT, counts)
    return created
