"""The SQL of each store operation, applied inside the writer's transaction.

Each kind of operation is applied in bulk: one ``SELECT ... IN`` for every key
the batch reads, one ``executemany`` for every row it writes. Counters (hits and
settles, :mod:`.counters`) are written through (one upsert per key per
transaction, never delete-then-insert); expired rows are pruned when touched,
plus a bounded number of others per transaction, so the tables stay bounded
without a sweeper. Claims take the
key's OFD lock (see :mod:`.claims`) before they read; the caller unlocks what a
rolled-back transaction took.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from ..base import (
    Claim,
    Hit,
    Lookup,
    Parts,
    Release,
    Save,
    Settle,
    StoredResponse,
    StoreOp,
    Vacate,
    stored_size,
)
from .claims import SQLiteClaims
from .counters import apply_counters, apply_lone_hit, prune_counters
from .saves import Bodies, Heads, Usage, Writes, chunks
from .slots import SQLiteSlots

__all__ = ["apply_batch", "prune_expired"]


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

    ``names``: counter-name ids this connection already read (see counters._name_ids).
    ``bodies``: the side file of big bodies (None: every body is in the row).
    ``heads``: the stored forms of recent response heads (see headers_json).
    ``slots``: this store's concurrency slots (None: a hit with slots is refused).
    """
    if len(ops) == 1:
        op = ops[0]
        if (
            type(op) is Hit
            and len(op.keys) == 1
            and op.algorithms is None
            and (op.slots is None or slots is not None)
        ):
            # The uncontended request's batch (see KeyPool.apply_now): the same rows and
            # verdict as _apply_counters, without its per-batch sets, dicts and SQL text.
            created = apply_lone_hit(conn, op, now, wall, {} if names is None else names, slots)
            # The same prunes, each run only when the index shows it has a row to
            # delete: one two-probe statement instead of two DELETEs that find nothing.
            responses, counts = conn.execute(_ANY_EXPIRED, (now,)).fetchone()
            if responses:
                conn.execute(_PRUNE_RESPONSES, (now, prune))
            if counts:
                prune_counters(conn, now, max(prune, 2 * created))
            if slots is not None:
                slots.write(conn)
            return
    if slots is not None and ops and type(ops[0]) is Vacate:
        vacates = [op for op in ops if isinstance(op, Vacate)]
        if len(vacates) == len(ops):
            # Freed slots (responses ended) write this holder's rows and nothing else.
            for vacate in vacates:
                slots.vacate(vacate)
            slots.write(conn)
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
        # A key both read and written in one batch: keep arrival order exactly, each
        # write's row written at once, for a later read of its key to see.
        batch = Writes(now, wall, claims, bodies, heads, usage)
        for op in ops:
            if type(op) is Claim or type(op) is Lookup:
                _apply_reads(conn, [op], now, claims, bodies, usage)
            elif type(op) is Save or type(op) is Release:
                batch.add(op)
                batch.write(conn)
    elif not writes:
        if reads:
            _apply_reads(conn, reads, now, claims, bodies, usage)
    else:
        # Reads in one SELECT, response rows in one executemany. Ops on different keys
        # still share the quotas' figures, so those are decided in arrival order: a
        # claim's reservation counts what an earlier release freed or save took (as on
        # PostgreSQL and Redis), never what a later one did.
        taken = _answer_reads(conn, reads, now, claims, bodies) if reads else []
        pending = {id(op) for op in taken}  # neither held elsewhere nor answered stored
        batch = Writes(now, wall, claims, bodies, heads, usage)
        granted: list[Claim] = []
        for op in ops if taken else writes:
            if type(op) is Save or type(op) is Release:
                batch.add(op)
            elif type(op) is Claim and id(op) in pending and _reserved(op, usage, claims):
                granted.append(op)
        batch.write(conn)
        _grant(conn, granted, claims)
    usage.flush()
    # Every transaction, not only saves: a store that only answers lookups and hits
    # must still give back what expired. Bounded, and an index probe when nothing did.
    conn.execute(_PRUNE_RESPONSES, (now, max(prune, 2 * len(writes))))
    if counters:
        created = apply_counters(conn, counters, now, wall, {} if names is None else names, slots)
        prune_counters(conn, now, max(prune, 2 * created))
    if slots is not None:
        slots.write(conn)


def prune_expired(conn: sqlite3.Connection, now: float, rows: int) -> int:
    """Delete up to ``rows`` expired responses; how many went. (Counters are a few dozen
    bytes each and pruned by the hits that come; responses are what fill a disk.)"""
    return int(conn.execute(_PRUNE_RESPONSES, (now, rows)).rowcount)


def _apply_reads(
    conn: sqlite3.Connection,
    reads: list[Claim | Lookup],
    now: float,
    claims: SQLiteClaims,
    bodies: Bodies | None,
    usage: Usage,
) -> None:
    taken = _answer_reads(conn, reads, now, claims, bodies)
    _grant(conn, [op for op in taken if _reserved(op, usage, claims)], claims)


def _answer_reads(
    conn: sqlite3.Connection,
    reads: list[Claim | Lookup],
    now: float,
    claims: SQLiteClaims,
    bodies: Bodies | None,
) -> list[Claim]:
    """Answer the lookups, and the claims held elsewhere or answered from the store; the
    claims whose keys this transaction took, in order, still to reserve and grant."""
    keys: list[str] = []
    for op in reads:
        if type(op) is Claim and not claims.take(op.key):
            op.held = True  # an OFD lock dies with its holder: no lease to wait out
            continue
        keys.append(op.key)
    found = _select_responses(conn, keys, now, bodies) if keys else {}
    taken: list[Claim] = []
    for op in reads:
        if type(op) is Lookup:
            op.result = found.get(op.key)
        elif type(op) is Claim and not op.held:
            stored = found.get(op.key)
            if stored is not None:
                op.stored = stored
                claims.end(op.key)  # nothing to own: answered from the store
            else:
                taken.append(op)
    return taken


def _reserved(op: Claim, usage: Usage, claims: SQLiteClaims) -> bool:
    """Whether the claim ``op`` took keeps it: True once its quota's room (if any) is
    reserved; False, its key given back, when a cap refuses it."""
    if op.quota is None or op.reserve <= 0:
        return True
    over = usage.reserve(op.key, op.scope, op.client, op.reserve, op.quota)
    if over is None:
        return True
    op.over = over
    claims.end(op.key)  # its response could not be stored: not taken
    return False


def _grant(conn: sqlite3.Connection, granted: list[Claim], claims: SQLiteClaims) -> None:
    if granted:
        first = _next_tokens(conn, len(granted), claims)
        for i, op in enumerate(granted):
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
        for key, digest, status, headers, body, expires, blob, size in conn.execute(
            "SELECT key, digest, status, headers, body, expires, blob, size FROM responses"
            f" WHERE key IN ({marks})",
            chunk,
        ):
            if now >= expires:
                expired.append((key,))  # pruned when touched
                continue
            head = tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(headers))
            parts = None
            if blob is not None:
                # The body's length: what its row counts, but for the key, digest and head.
                length = size - stored_size(key, StoredResponse(digest, 0, head, b""))
                kept = None if bodies is None else bodies.find(int(blob), key, length)
                if kept is None:
                    # The side file lost it (a power loss under durability="process"):
                    # no stored response, so the key is served again.
                    expired.append((key,))
                    continue
                if isinstance(kept, Parts):
                    body, parts = b"", kept
                else:
                    body = kept
            found[key] = StoredResponse(bytes(digest), int(status), head, bytes(body), parts)
    if expired:
        conn.executemany("DELETE FROM responses WHERE key = ?", expired)
    return found
