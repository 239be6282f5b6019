"""How a batch's saves are written: the stored form of a response, quotas, and the
bodies that live in the side file (see :mod:`.blobs`)."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from typing import Any, Protocol, TypeGuard

from ..base import Quota, Release, Save, StoredResponse, StoreOp
from .claims import SQLiteClaims

__all__ = [
    "BLOB_ABOVE",
    "HEADS_MAX",
    "Bodies",
    "Heads",
    "apply_writes",
    "chunks",
    "has_blob",
    "headers_json",
    "stored_size",
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

    def read(self, blob: int, key: str) -> bytes | None: ...


_UPSERT_RESPONSE = (
    "INSERT INTO responses"
    " (key, digest, status, headers, body, stored_at, expires, stored_wall, scope, size, blob)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (key) DO UPDATE SET digest = excluded.digest, status = excluded.status,"
    " headers = excluded.headers, body = excluded.body, stored_at = excluded.stored_at,"
    " expires = excluded.expires, stored_wall = excluded.stored_wall,"
    " scope = excluded.scope, size = excluded.size, blob = excluded.blob"
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


def stored_size(key: str, response: StoredResponse, headers: str) -> int:
    """The bytes a stored response counts against its quotas: key, digest, headers, body."""
    return (
        len(key.encode("utf-8", "surrogatepass"))
        + len(response.digest)
        + len(headers.encode("latin-1"))
        + len(response.body)
    )


class _Usage:
    """Stored bytes per scope and in total, read once per transaction and kept current."""

    __slots__ = ("conn", "now", "pruned", "scopes", "total")

    def __init__(self, conn: sqlite3.Connection, scopes: set[str], now: float) -> None:
        self.conn = conn
        self.now = now
        self.scopes: dict[str, int] = dict.fromkeys(scopes, 0)
        for chunk in chunks(list(scopes)):
            marks = ",".join("?" * len(chunk))
            for scope, used in conn.execute(
                f"SELECT scope, bytes FROM response_bytes WHERE scope IN ({marks})", chunk
            ):
                self.scopes[scope] = int(used)
        self.total = self._read_total()
        self.pruned = False

    def _read_total(self) -> int:
        return int(self.conn.execute("SELECT bytes FROM response_total").fetchone()[0])

    def _reread(self) -> None:
        # Pruning changed rows of scopes other than the one being checked, too.
        for scope in self.scopes:
            row = self.conn.execute(
                "SELECT bytes FROM response_bytes WHERE scope = ?", (scope,)
            ).fetchone()
            self.scopes[scope] = 0 if row is None else int(row[0])
        self.total = self._read_total()

    def admit(self, scope: str, size: int, quota: Quota) -> bool:
        """Whether ``size`` more bytes fit; expired rows are reclaimed before saying no."""
        over = (
            self.scopes[scope] + size > quota.scope_bytes or self.total + size > quota.total_bytes
        )
        if over and not self.pruned:
            # Every expired row goes (through the expiry index), once per transaction:
            # each row is deleted once, so a client at its quota cannot make this costly.
            self.pruned = True
            self.conn.execute(_PRUNE_ALL_EXPIRED, (self.now,))
            self._reread()
            over = (
                self.scopes[scope] + size > quota.scope_bytes
                or self.total + size > quota.total_bytes
            )
        if over:
            return False
        self.scopes[scope] += size
        self.total += size
        return True


def apply_writes(
    conn: sqlite3.Connection,
    writes: list[Save | Release],
    now: float,
    wall: float,
    claims: SQLiteClaims,
    bodies: Bodies | None,
    heads: Heads | None = None,
) -> None:
    usage: _Usage | None = None
    placed = {} if bodies is None else bodies.placed
    rows: list[tuple[Any, ...]] = []
    for op in writes:
        if type(op) is Release:
            op.released = claims.current(op.key, op.token)
            continue
        if type(op) is not Save:  # pragma: no cover - only Save and Release are writes
            continue
        if op.token and not claims.current(op.key, op.token):
            op.outcome = "fenced"  # a newer claim exists: never overwrite its response
            continue
        response = op.response
        headers = headers_json(response.headers, heads)
        size = stored_size(op.key, response, headers)
        if op.quota is not None:
            if usage is None:
                usage = _Usage(conn, {w.scope for w in writes if type(w) is Save and w.quota}, now)
            if not usage.admit(op.scope, size, op.quota):
                op.outcome = "quota"
                continue
        body = response.body
        blob = placed.get(id(op))
        if blob is not None:
            body = b""  # committed in the side file before this batch came
        rows.append(
            (
                op.key,
                bytearray(response.digest),
                response.status,
                headers,
                bytearray(body) if len(body) <= _COPY_BELOW else body,
                now,
                now + op.ttl,
                wall,
                op.scope,
                size,
                blob,
            )
        )
        op.outcome = "saved"
    if rows:
        conn.executemany(_UPSERT_RESPONSE, rows)
