"""How a batch's saves are written: the stored form of a response, quotas, and the
bodies that live in the side file (see :mod:`.blobs`)."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from typing import Any, Protocol, TypeGuard

from ..base import Parts, Quota, QuotaBucket, Release, Save, StoreOp
from .claims import SQLiteClaims

__all__ = [
    "BLOB_ABOVE",
    "HEADS_MAX",
    "Bodies",
    "Heads",
    "Usage",
    "Writes",
    "chunks",
    "has_blob",
    "headers_json",
]

# Bodies above this live in the side file (blobs.py), written apart from the decisions;
# their saves leave the pool's batches too (Capabilities.solo_save_bytes).
BLOB_ABOVE = 64 * 1024


def has_blob(op: StoreOp) -> TypeGuard[Save]:
    """Whether ``op`` saves a body that goes to the side file."""
    return type(op) is Save and len(op.response.body) > BLOB_ABOVE


class Bodies(Protocol):
    """Where big bodies live (the side file, see blobs.py), as the decision writer sees it."""

    # id(Save) -> the blob holding its body, written and committed before the batch came.
    placed: dict[int, int]

    def find(self, blob: int, key: str, length: int) -> bytes | Parts | None:
        """``key``'s body kept as ``blob`` (``length`` bytes), whole or in parts; None if
        it is not all there."""
        ...


_UPSERT_RESPONSE = (
    "INSERT INTO responses (key, digest, status, headers, body, stored_at, expires,"
    " stored_wall, scope, client, size, blob) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET digest = excluded.digest, status = excluded.status,"
    " headers = excluded.headers, body = excluded.body, stored_at = excluded.stored_at,"
    " expires = excluded.expires, stored_wall = excluded.stored_wall,"
    " scope = excluded.scope, client = excluded.client, size = excluded.size,"
    " blob = excluded.blob"
)
_PRUNE_ALL_EXPIRED = "DELETE FROM responses WHERE expires <= ?"
# sqlite3 binds int, float, str and bytearray directly, but sends bytes through its
# adapter lookup (a registry probe and two failed attribute lookups, ~1 us each): a
# small blob is cheaper copied into a bytearray. A big one is not worth the copy.
_COPY_BELOW = 64 << 10
_SELECT_CHUNK = 256  # keys per SELECT ... IN (...), below SQLite's variable limit


def chunks(keys: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(keys), _SELECT_CHUNK):
        yield keys[i : i + _SELECT_CHUNK]


# Printable ASCII but '"' and '\\': bytes JSON writes as they are.
_JSON_PLAIN = re.compile(rb"[ !#-\[\]-~]*")


# Bound of a recent-heads dict (see headers_json).
HEADS_MAX = 256
Heads = dict[tuple[tuple[bytes, bytes], ...], str]


def headers_json(headers: tuple[tuple[bytes, bytes], ...], recent: Heads | None = None) -> str:
    """The stored form of a response's headers: exactly ``json.dumps`` of the latin-1
    pairs, written directly when every byte is plain (the usual head), which costs a
    fraction of the encoder's setup per call.

    ``recent`` (the writer's) keeps the forms of recent heads: an endpoint sends the same
    few (its content type), whose form is then one dict lookup, not ~1 us of encoding
    per save. Emptied when full, so heads that never repeat (a Location per resource)
    cannot keep the common ones out for long."""
    if recent is None:
        return _headers_json(headers)
    try:
        return recent[headers]
    except KeyError:
        pass
    except TypeError:  # no dict key (a bytearray value): encoded, not kept
        return _headers_json(headers)
    stored = recent[headers] = _headers_json(headers)
    if len(recent) > HEADS_MAX:
        recent.clear()
    return stored


def _headers_json(headers: tuple[tuple[bytes, bytes], ...]) -> str:
    if _JSON_PLAIN.fullmatch(b" ".join([b" ".join(pair) for pair in headers])) is None:
        return json.dumps([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])
    return "[" + ", ".join([f'["{k.decode()}", "{v.decode()}"]' for k, v in headers]) + "]"


# A key's row left by a dead holder is freed (and counted) first: a plain insert.
_INSERT_RESERVATION = "INSERT INTO reservations (key, scope, client, size) VALUES (?, ?, ?, ?)"


class Usage:
    """Stored and reserved bytes per scope, per client and in all, as one transaction sees
    them: each figure read once, kept current with what the transaction writes, also
    before its response rows are written at its end.

    The totals count stored responses through the triggers of their table, and the
    reservations of claims through this class: a reservation's bytes go into ``changed``
    as it is inserted or deleted, and reach the tables once, in :meth:`flush`, at the
    transaction's end (a batch of claims of one client updates three rows once, not
    three rows per claim; schema 11 dropped the reservations' triggers)."""

    __slots__ = ("changed", "claims", "conn", "now", "pending", "read", "reclaimed")

    def __init__(self, conn: sqlite3.Connection, now: float, claims: SQLiteClaims) -> None:
        self.conn = conn
        self.now = now
        self.claims = claims
        # ("s", scope) / ("c", client) / ("t", ""): bytes in the tables when read.
        self.read: dict[tuple[str, str], int] = {}
        # Bytes of response rows admitted but not written yet (Writes.write).
        self.pending: dict[tuple[str, str], int] = {}
        # Bytes of reservations inserted (or, negative, deleted) but not in the totals yet.
        self.changed: dict[tuple[str, str], int] = {}
        self.reclaimed = False

    def _get(self, bucket: tuple[str, str]) -> int:
        used = self.read.get(bucket)
        if used is None:
            kind, name = bucket
            if kind == "s":
                row = self.conn.execute(_SCOPE_BYTES, (name,)).fetchone()
            elif kind == "c":
                row = self.conn.execute(_CLIENT_BYTES, (name,)).fetchone()
            else:
                row = self.conn.execute(_TOTAL_BYTES).fetchone()
            used = (0 if row is None else int(row[0])) + self.changed.get(bucket, 0)
            self.read[bucket] = used
        return used + self.pending.get(bucket, 0)

    def count_reservation(self, scope: str, client: str, delta: int) -> None:
        """A reservation of ``delta`` bytes was inserted (or deleted) now; the totals take
        it at :meth:`flush`."""
        changed, read = self.changed, self.read
        for bucket in (("s", scope), ("c", client), ("t", "")):
            changed[bucket] = changed.get(bucket, 0) + delta
            if bucket in read:
                read[bucket] += delta

    def flush(self) -> None:
        """Add the reservations' changes to the totals (in the transaction that made them)."""
        conn = self.conn
        for (kind, name), delta in self.changed.items():
            if delta == 0:
                continue
            if kind == "t":
                conn.execute(_ADD_TOTAL, (delta,))
            elif delta > 0:
                conn.execute(_ADD[kind], (name, delta))
            else:  # as the responses' triggers do: a figure that reaches 0 loses its row
                take, drop = _TAKE[kind]
                conn.execute(take, (-delta, name))
                conn.execute(drop, (name,))
        self.changed.clear()

    def will_write(self, scope: str, client: str, size: int) -> None:
        """A response row of ``size`` bytes is admitted, to be written at the batch's end."""
        for bucket in (("s", scope), ("c", client), ("t", "")):
            self.pending[bucket] = self.pending.get(bucket, 0) + size

    def wrote(self) -> None:
        """The admitted rows were written: the tables count them now, so a figure read
        again (after a reclaim) must not count them a second time."""
        read = self.read
        for bucket, size in self.pending.items():
            if bucket in read:
                read[bucket] += size
        self.pending.clear()

    def _over(self, scope: str, client: str, size: int, quota: Quota) -> QuotaBucket | None:
        if self._get(("s", scope)) + size > quota.scope_bytes:
            return "scope"
        if self._get(("c", client)) + size > quota.client_bytes:
            return "client"
        if self._get(("t", "")) + size > quota.total_bytes:
            return "total"
        return None

    def admit(self, scope: str, client: str, size: int, quota: Quota) -> QuotaBucket | None:
        """None if ``size`` more bytes fit every cap, else the cap they would pass. Before
        saying no, expired responses and the reservations of dead holders are reclaimed."""
        over = self._over(scope, client, size, quota)
        if over is not None and not self.reclaimed:
            # Once per transaction: each row is deleted once, so a caller at its quota
            # cannot make this costly. Every expired row goes, through the expiry index.
            self.reclaimed = True
            self.conn.execute(_PRUNE_ALL_EXPIRED, (self.now,))
            self._reclaim_reservations()
            self.read.clear()  # the prune changed other scopes' and clients' figures too
            over = self._over(scope, client, size, quota)
        return over

    def _reclaim_reservations(self) -> None:
        """Delete the reservations whose claim nobody holds: their holder died (its lock
        went with it). A claim of this process or a live one elsewhere keeps its lock."""
        claims = self.claims
        found = self.conn.execute("SELECT key, scope, client, size FROM reservations").fetchall()
        for key, scope, client, size in found:
            if claims.take(key):
                self.conn.execute("DELETE FROM reservations WHERE key = ?", (key,))
                self.count_reservation(scope, client, -int(size))
                claims.end(key)

    def reserve(
        self, key: str, scope: str, client: str, size: int, quota: Quota
    ) -> QuotaBucket | None:
        """Reserve ``size`` bytes for the claim this transaction takes on ``key`` (None), or
        name the cap they would pass (nothing reserved)."""
        self.free(key)  # a reservation left on this key is a dead holder's: its lock is ours
        over = self.admit(scope, client, size, quota)
        if over is None:
            self.conn.execute(_INSERT_RESERVATION, (key, scope, client, size))
            self.count_reservation(scope, client, size)
        return over

    def free(self, key: str) -> None:
        """Delete ``key``'s reservation, if it has one (its claim is saved or released)."""
        row = self.conn.execute(_SELECT_RESERVATION, (key,)).fetchone()
        if row is not None:
            self.conn.execute("DELETE FROM reservations WHERE key = ?", (key,))
            self.count_reservation(row[0], row[1], -int(row[2]))


_ADD_TOTAL = "UPDATE response_total SET bytes = bytes + ?"
_ADD = {
    "s": "INSERT INTO response_bytes (scope, bytes) VALUES (?, ?)"
    " ON CONFLICT (scope) DO UPDATE SET bytes = bytes + excluded.bytes",
    "c": "INSERT INTO client_bytes (client, bytes) VALUES (?, ?)"
    " ON CONFLICT (client) DO UPDATE SET bytes = bytes + excluded.bytes",
}
_TAKE = {
    "s": (
        "UPDATE response_bytes SET bytes = bytes - ? WHERE scope = ?",
        "DELETE FROM response_bytes WHERE scope = ? AND bytes <= 0",
    ),
    "c": (
        "UPDATE client_bytes SET bytes = bytes - ? WHERE client = ?",
        "DELETE FROM client_bytes WHERE client = ? AND bytes <= 0",
    ),
}
_SCOPE_BYTES = "SELECT bytes FROM response_bytes WHERE scope = ?"
_CLIENT_BYTES = "SELECT bytes FROM client_bytes WHERE client = ?"
_TOTAL_BYTES = "SELECT bytes FROM response_total"
_SELECT_RESERVATION = "SELECT scope, client, size FROM reservations WHERE key = ?"


class Writes:
    """A batch's saves and releases: each decided as it comes (fences, reservations freed,
    quotas), the response rows written together by :meth:`write`."""

    __slots__ = ("claims", "heads", "now", "placed", "rows", "usage", "wall")

    def __init__(
        self,
        now: float,
        wall: float,
        claims: SQLiteClaims,
        bodies: Bodies | None,
        heads: Heads | None,
        usage: Usage,
    ) -> None:
        self.now = now
        self.wall = wall
        self.claims = claims
        self.placed = {} if bodies is None else bodies.placed
        self.heads = heads
        self.usage = usage
        self.rows: list[tuple[Any, ...]] = []

    def add(self, op: Save | Release) -> None:
        claims, usage = self.claims, self.usage
        if type(op) is Release:
            op.released = claims.current(op.key, op.token)
            if op.released:
                usage.free(op.key)
            return
        if type(op) is not Save:  # pragma: no cover - only Save and Release are writes
            return
        if op.token:
            if not claims.current(op.key, op.token):
                op.outcome = "fenced"  # a newer claim exists: never overwrite its response
                return
            usage.free(op.key)  # the claim's reservation: replaced by the response's size
        response = op.response
        headers = headers_json(response.headers, self.heads)
        size = op.size
        if op.quota is not None:
            if usage.admit(op.scope, op.client, size, op.quota) is not None:
                op.outcome = "quota"
                return
            usage.will_write(op.scope, op.client, size)
        body = response.body
        blob = self.placed.get(id(op))
        if blob is not None:
            body = b""  # committed in the side file before this batch came
        elif response.parts is not None:
            blob = response.parts.id  # streamed to the side file in parts, and kept
        now = self.now
        self.rows.append(
            (
                op.key,
                bytearray(response.digest),
                response.status,
                headers,
                bytearray(body) if len(body) <= _COPY_BELOW else body,
                now,
                now + op.ttl,
                self.wall,
                op.scope,
                op.client,
                size,
                blob,
            )
        )
        op.outcome = "saved"

    def write(self, conn: sqlite3.Connection) -> None:
        """Write the rows added since the last write."""
        if self.rows:
            conn.executemany(_UPSERT_RESPONSE, self.rows)
            self.rows.clear()
            self.usage.wrote()
