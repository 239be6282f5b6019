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

from ...errors import StoreError
from ..algorithms import FIXED, State, expiry, fresh, read, settle
from ..base import Claim, Hit, Lookup, Release, Save, Settle, StoredResponse, StoreOp, Vacate
from .claims import SQLiteClaims
from .saves import Bodies, Heads, Usage, apply_writes, chunks
from .slots import SQLiteSlots

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
    slots: SQLiteSlots | None = None,
) -> None:
    """Apply ``ops`` with the clock read once for the whole transaction.

    ``names``: counter-name ids this connection already read (see _name_ids).
    ``bodies``: the side file of big bodies (None: every body is in the row).
    ``heads``: the stored forms of recent response heads (see headers_json).
    ``slots``: this store's concurrency slots (None: a hit with slots is refused).
    """
    if len(ops) == 1:
        op = ops[0]
        if type(op) is Hit and len(op.keys) == 1 and op.algorithms is None and op.slots is None:
            # The uncontended request's batch (see KeyPool.apply_now): the same rows and
            # verdict as _apply_counters, without its per-batch sets, dicts and SQL text.
            created = _apply_lone_hit(conn, op, now, wall, {} if names is None else names)
            # The same prunes, each run only when the index shows it has a row to
            # delete: one two-probe statement instead of two DELETEs that find nothing.
            responses, counts = conn.execute(_ANY_EXPIRED, (now,)).fetchone()
            if responses:
                conn.execute(_PRUNE_RESPONSES, (now, prune))
            if counts:
                _prune_counters(conn, now, max(prune, 2 * created))
            return
    counters: list[Hit | Settle | Vacate] = []
    reads: list[Claim | Lookup] = []
    writes: list[Save | Release] = []
    for op in ops:
        if type(op) is Hit or type(op) is Settle or type(op) is Vacate:
            counters.append(op)
        elif type(op) is Claim or type(op) is Lookup:
            reads.append(op)
        elif type(op) is Save or type(op) is Release:
            writes.append(op)
    # Stored and reserved bytes, read only if a claim or save of this batch has a quota.
    usage = Usage(conn, now, claims)
    if reads and writes and {op.key for op in reads} & {op.key for op in writes}:
        # A key both read and written in one batch: keep arrival order exactly.
        for op in ops:
            if type(op) is Claim or type(op) is Lookup:
                _apply_reads(conn, [op], now, claims, bodies, usage)
            elif type(op) is Save or type(op) is Release:
                apply_writes(conn, [op], now, wall, claims, bodies, heads, usage)
    else:
        if reads:
            _apply_reads(conn, reads, now, claims, bodies, usage)
        if writes:
            apply_writes(conn, writes, now, wall, claims, bodies, heads, usage)
    # Every transaction, not only saves: a store that only answers lookups and hits
    # must still give back what expired. Bounded, and an index probe when nothing did.
    conn.execute(_PRUNE_RESPONSES, (now, max(prune, 2 * len(writes))))
    if counters:
        created = _apply_counters(conn, counters, now, wall, {} if names is None else names, slots)
        _prune_counters(conn, now, max(prune, 2 * created))
    if slots is not None:
        slots.write(conn)


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
    usage: Usage,
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
            elif (
                op.quota is not None
                and op.reserve > 0
                and (over := usage.reserve(op.key, op.scope, op.client, op.reserve, op.quota))
            ):
                op.over = over
                claims.end(op.key)  # its response could not be stored: not taken
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


# A one-limit hit's fits, shared (immutable): one allocation fewer per request.
_FITS, _REFUSED = (True,), (False,)

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


_SELECT_COUNTER = "SELECT count, window_start, expires FROM counts WHERE name = ? AND client = ?"
_UPDATE_COUNT = "UPDATE counts SET count = ? WHERE name = ? AND client = ?"


def _apply_lone_hit(
    conn: sqlite3.Connection, hit: Hit, now: float, wall: float, known: dict[str, int]
) -> int:
    """A batch of one fixed-window hit on one limit: _apply_counters's rows and verdict, with
    one row read and at most one statement written; 1 if it created the row, else 0."""
    key = hit.keys[0]
    prefix, client = split_key(key)
    name = known.get(prefix)
    if name is None:
        name = _name_ids(conn, [prefix], known)[prefix]
    row = conn.execute(_SELECT_COUNTER, (name, client)).fetchone()
    amount = hit.amounts[0]
    cost = hit.cost
    if row is None or now >= row[2]:
        # A fresh window, or an elapsed one overwritten in place (as in _apply_counters).
        count, start, expires = 0, now, now + hit.windows[0]
        allowed = cost <= amount
        if allowed:
            count = cost
            conn.execute(_UPSERT_COUNTER, (name, client, count, now, expires, wall))
    else:
        count, start, expires = row
        allowed = count + cost <= amount
        if allowed:
            count += cost
            conn.execute(_UPDATE_COUNT, (count, name, client))
    hit.allowed = allowed
    hit.fits = _FITS if allowed else _REFUSED
    hit.remaining = [amount - count if count < amount else 0]
    # A fixed window's next, full and retry are all its end: one list, read only.
    hit.next = hit.full = hit.retry = [expires - now]
    hit.stamp = [start]
    hit.wall = wall
    return 1 if row is None and allowed else 0


def _read_counters(
    conn: sqlite3.Connection, keys: set[str], known: dict[str, int]
) -> tuple[dict[str, list[Any]], dict[str, tuple[str, str]], dict[str, int]]:
    """The rows of ``keys`` (key -> [count, window_start, expires, wall_start, write]),
    each key's (prefix, client), and the prefixes' ids."""
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
            for client, count, start, expires, wall_start in conn.execute(
                "SELECT client, count, window_start, expires, wall_start FROM counts"
                f" WHERE name = ? AND client IN ({marks})",
                [name, *chunk],
            ):
                rows[of_prefix[client]] = [count, start, expires, wall_start, _CLEAN]
    return rows, places, names


def _write_counters(
    conn: sqlite3.Connection,
    rows: dict[str, list[Any]],
    places: dict[str, tuple[str, str]],
    names: dict[str, int],
) -> None:
    """Write each changed row once: a new window in full, a count alone otherwise."""
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


def _apply_counters(
    conn: sqlite3.Connection,
    ops: list[Hit | Settle | Vacate],
    now: float,
    wall: float,
    known: dict[str, int],
    slots: SQLiteSlots | None = None,
) -> int:
    """Decide the hits and apply the settles and vacates in arrival order; how many rows
    were created.

    Every key is read once per transaction and written once per transaction, however
    many ops share it.
    """
    keys = {key for op in ops if not isinstance(op, Vacate) for key in op.keys}
    rows, places, names = _read_counters(conn, keys, known)
    created = 0
    for op in ops:
        if isinstance(op, Settle):
            _settle(op, rows, now, wall)
            continue
        if isinstance(op, Vacate):
            if slots is not None:
                slots.vacate(op)
            continue
        hit = op
        cost = hit.cost
        if hit.algorithms is None and len(hit.keys) == 1 and hit.slots is None:
            # One fixed window (the common rule): no per-limit lists to build.
            key = hit.keys[0]
            amount = hit.amounts[0]
            row = rows.get(key)
            if row is None or now >= row[2]:
                fresh: list[Any] = [0, now, now + hit.windows[0], wall, _WINDOW]
                allowed = cost <= amount
                if allowed:
                    if row is None:
                        created += 1
                    row = rows[key] = fresh
                    row[0] = cost
                else:
                    row = fresh
            else:
                allowed = row[0] + cost <= amount
                if allowed:
                    row[0] += cost
                    if row[4] == _CLEAN:
                        row[4] = _COUNT
            count = row[0]
            hit.allowed = allowed
            hit.fits = _FITS if allowed else _REFUSED
            hit.remaining = [amount - count if count < amount else 0]
            hit.next = hit.full = hit.retry = [row[2] - now]
            hit.stamp = [row[1]]
            hit.wall = wall
            continue
        if hit.algorithms is not None and any(a != "fixed" for a in hit.algorithms):
            raise StoreError(f"the SQLite store cannot decide {list(hit.algorithms)} yet")
        # The window each limit's hit falls in: a row's own, or a fresh one (an elapsed
        # or absent window is replaced only by an allowed hit: a refusal writes nothing).
        current: list[list[Any]] = []
        fits: list[bool] = []
        for key, amount, window in zip(hit.keys, hit.amounts, hit.windows, strict=True):
            row = rows.get(key)
            if row is None or now >= row[2]:
                row = [0, now, now + window, wall, _WINDOW]
            current.append(row)
            fits.append(row[0] + cost <= amount)
        allowed = all(fits)
        if hit.slots is not None:
            # Counted whatever the rate limits say (the headers report them); taken only
            # with the units: all or nothing.
            if slots is None:
                raise StoreError("this SQLite store takes no concurrency slots")
            free = slots.count(conn, hit)
            allowed = allowed and free
            if allowed:
                slots.take(hit)
        if allowed:
            for key, row in zip(hit.keys, current, strict=True):
                row[0] += cost
                if row[4] == _CLEAN:
                    row[4] = _COUNT
                elif rows.get(key) is not row:
                    if key not in rows:
                        created += 1
                    rows[key] = row  # the new window replaces an elapsed one in place
        hit.allowed = allowed
        hit.fits = fits
        hit.remaining = [
            amount - row[0] if row[0] < amount else 0
            for row, amount in zip(current, hit.amounts, strict=True)
        ]
        hit.next = hit.full = hit.retry = [row[2] - now for row in current]
        hit.stamp = [row[1] for row in current]
        hit.wall = wall
    _write_counters(conn, rows, places, names)
    return created


def _settle(op: Settle, rows: dict[str, list[Any]], now: float, wall: float) -> None:
    """Charge or refund a settle's units (docs/design.md, "Policies": the settle rule)."""
    if op.algorithms is not None and any(a != "fixed" for a in op.algorithms):
        raise StoreError(f"the SQLite store cannot settle {list(op.algorithms)} yet")
    for key, amount, window, delta, stamp in zip(
        op.keys, op.amounts, op.windows, op.deltas, op.stamps, strict=True
    ):
        row = rows.get(key)
        if row is None or now >= row[2]:
            state: State = fresh(FIXED, now)
        else:
            state = read(FIXED, row[0], 0, row[1], now, window)
        settled = settle(FIXED, state, now, delta, stamp, amount, window)
        if settled is None:
            continue
        n, _, s = settled
        if row is not None and row[1] == s and now < row[2]:
            row[0] = n
            if row[4] == _CLEAN:
                row[4] = _COUNT
        else:
            rows[key] = [n, s, expiry(FIXED, s, window), wall, _WINDOW]
