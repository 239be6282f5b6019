"""Encoding a batch as the apply function's arguments, and its rows back into the ops' results."""

from __future__ import annotations

import json
from typing import Any

from ...errors import StoreError
from .._heads import PARTS_HEADER, join_parts, split_parts
from .._leases import CLAIM, HeldLeases
from ..base import (
    Claim,
    Hit,
    Lookup,
    Quota,
    QuotaBucket,
    Release,
    Save,
    Settle,
    StoredResponse,
    StoreOp,
    Vacate,
)
from .hits import CounterArrays, fill_counters

__all__ = ["Op", "Renew", "arguments", "fill_from_rows"]

_HIT, _LOOKUP, _CLAIM, _SAVE, _RELEASE, _RENEW, _SETTLE = 1, 2, 3, 4, 5, 6, 7
_BUCKETS: tuple[QuotaBucket, ...] = ("scope", "client", "total")
_NO_QUOTA = (1 << 62, 1 << 62, 1 << 62)


class Renew:
    """Extend the lease of a claim this process holds (the heartbeat's op)."""

    __slots__ = ("key", "renewed", "token")

    def __init__(self, key: str, token: int) -> None:
        self.key = key
        self.token = token
        self.renewed = False


Op = StoreOp | Renew


def arguments(
    ops: list[Op],
    alike: dict[int, list[Hit]],
    lease: float,
    prune: int,
    channel: str,
    now: float | None,
) -> list[Any]:
    """The apply function's 31 arguments for a batch (``alike``: see collapse_hits;
    ``now``: the counters' time from a test clock, None: the server's)."""
    n = len(ops)
    kinds = [0] * n
    keys: list[str] = [""] * n
    counters = CounterArrays()
    hops: list[int] = []
    tokens: list[int | None] = [None] * n
    digests: list[bytes | None] = [None] * n
    statuses: list[int | None] = [None] * n
    headers: list[str | None] = [None] * n
    bodies: list[bytes | None] = [None] * n
    ttls: list[float | None] = [None] * n
    scopes: list[str | None] = [None] * n
    scope_caps: list[int | None] = [None] * n
    total_caps: list[int | None] = [None] * n
    clients: list[str | None] = [None] * n
    client_caps: list[int | None] = [None] * n
    reserves: list[int | None] = [None] * n
    sizes: list[int | None] = [None] * n
    for i, op in enumerate(ops):
        # isinstance narrows each op for the type checker (no casts, no ignores).
        if isinstance(op, Hit):
            kinds[i] = _HIT
            hops.append(i + 1)
            same = alike.get(i)
            counters.add(op, 1 if same is None else len(same))
            continue
        if isinstance(op, Settle):
            kinds[i] = _SETTLE
            hops.append(i + 1)
            counters.add(op, 0)
            continue
        if isinstance(op, Vacate):
            raise StoreError("the PostgreSQL store takes no concurrency slots")
        keys[i] = op.key
        if isinstance(op, Lookup):
            kinds[i] = _LOOKUP
        elif isinstance(op, Claim):
            kinds[i] = _CLAIM
            quota = op.quota
            if quota is None:
                reserves[i] = 0
            else:
                reserves[i] = op.reserve
                scopes[i] = op.scope
                clients[i] = op.client
                scope_caps[i], total_caps[i], client_caps[i] = _caps(quota)
        elif isinstance(op, Save):
            kinds[i] = _SAVE
            tokens[i] = op.token
            r = op.response
            digests[i] = r.digest
            statuses[i] = r.status
            head = join_parts(r.headers, r.parts)
            headers[i] = json.dumps([(k.decode("latin-1"), v.decode("latin-1")) for k, v in head])
            bodies[i] = r.body
            ttls[i] = float(op.ttl)
            scopes[i] = op.scope
            clients[i] = op.client
            sizes[i] = op.size
            scope_caps[i], total_caps[i], client_caps[i] = _caps(op.quota)
        elif isinstance(op, Release):
            kinds[i] = _RELEASE
            tokens[i] = op.token
        else:
            kinds[i] = _RENEW
            tokens[i] = op.token
    return [
        kinds, keys, *counters.arguments(), hops, tokens,
        digests, statuses, headers, bodies, ttls, scopes, scope_caps, total_caps, lease, prune,
        channel, clients, client_caps, reserves, sizes, now,
    ]  # fmt: skip


def _caps(quota: Quota | None) -> tuple[int, int, int]:
    """A quota's caps as the function takes them: scope, total, client."""
    if quota is None:
        return _NO_QUOTA
    return quota.scope_bytes, quota.total_bytes, quota.client_bytes


def fill_from_rows(
    ops: list[Op],
    alike: dict[int, list[Hit]],
    rows: list[Any],
    held: HeldLeases,
    wall: float | None = None,
) -> None:
    """Fill in each op's result from the function's rows; keep ``held`` current (claims
    taken and ended; a renewal's outcome is the heartbeat's to act on). ``wall``: the
    decisions' wall time when a test clock took them (None: the server's time)."""
    if any(type(op) is Hit for op in ops):
        fill_counters(ops, alike, rows, wall)
    for row in rows:
        i = row[0]
        if i == 0:
            continue
        op = ops[i - 1]
        code = row[1]
        kind = type(op)
        if kind is Hit:
            continue  # filled above
        elif kind is Lookup:
            lookup: Any = op
            lookup.result = _stored(row) if code == 1 else None
        elif kind is Claim:
            claim: Any = op
            if code == 1:
                claim.stored = _stored(row)
            elif code == 2:
                claim.held = True
                claim.retry_after = row[3]
            elif code == 4:  # over a quota: row[3] says which (1 scope, 2 client, 3 total)
                claim.over = _BUCKETS[int(row[3]) - 1]
            else:
                claim.token = row[2]
                held.hold(CLAIM, claim.key, claim.token)
        elif kind is Save:
            save: Any = op
            save.outcome = ("saved", "fenced", "quota")[code - 1]
            if save.token:
                held.end(CLAIM, save.key, save.token)
        elif kind is Release:
            release: Any = op
            release.released = code == 1
            held.end(CLAIM, release.key, release.token)
        else:
            renew: Any = op
            renew.renewed = code == 1


def _stored(row: Any) -> StoredResponse:
    text: str = row[9]
    head = tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(text))
    if _PARTS in text:  # (a substring test first: rare, and the usual head is short)
        head, parts = split_parts(head)
        return StoredResponse(bytes(row[7]), int(row[8]), head, bytes(row[10]), parts)
    return StoredResponse(bytes(row[7]), int(row[8]), head, bytes(row[10]))


_PARTS = PARTS_HEADER.decode()
