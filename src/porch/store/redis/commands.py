"""How a store op becomes one Redis command, and how the command's reply fills the op in.

A command is a server-side script call (by name; the store runs it by SHA) or,
for a Lookup, a plain HMGET of the key's record. The store sends a batch's
commands as one pipeline and fills each op in from its reply.
"""

from __future__ import annotations

import json
import math
from typing import Any, cast

from ...errors import StoreError
from .._heads import PARTS_HEADER, join_parts, split_parts
from .._leases import CLAIM, SLOT, HeldLeases
from ..algorithms import TAGS
from ..alike import fill_decided, fill_slots
from ..base import (
    Claim,
    Hit,
    Lookup,
    Quota,
    QuotaBucket,
    Release,
    Save,
    SaveOutcome,
    Settle,
    StoredResponse,
    StoreOp,
    Vacate,
)
from .keys import KeyNames

__all__ = ["Command", "books", "command", "fill_from_reply", "publish", "release", "wake"]

_DEFAULT_QUOTA = Quota()
_BUCKETS: tuple[QuotaBucket, ...] = ("scope", "client", "total")
# (script name, or None for a plain HMGET of the record; keys; arguments)
Command = tuple[str | None, list[bytes], list[bytes | str | int | float]]
_FIELDS = (b"d", b"s", b"h", b"b")


def _encode_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    return json.dumps([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]).encode()


def _stored(digest: bytes, status: bytes, headers: bytes, body: bytes) -> StoredResponse:
    head = tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(headers))
    if PARTS_HEADER in headers:  # (a substring test first: rare, and the usual head is short)
        head, parts = split_parts(head)
        return StoredResponse(bytes(digest), int(status), head, bytes(body), parts)
    return StoredResponse(bytes(digest), int(status), head, bytes(body))


def command(
    names: KeyNames,
    lease_ms: int,
    op: StoreOp,
    alike: list[Hit] | None = None,
    now: float | None = None,
) -> Command:
    """The command that applies ``op`` (``alike``: the hits collapsed into it; ``now``:
    the counters' time from a test clock, None: the server's)."""
    if type(op) is Hit or type(op) is Settle:
        # Floats go as repr() (redis-py's encoding), read back by Lua's strtod: exact.
        args: list[bytes | str | int | float] = [
            "" if now is None else now,
            0 if type(op) is Settle else 1 if alike is None else len(alike),
            op.cost if type(op) is Hit else 0,
        ]
        algorithms = op.algorithms
        bursts = op.bursts if op.bursts is not None else op.amounts
        for i, (amount, window) in enumerate(zip(op.amounts, op.windows, strict=True)):
            args += [0 if algorithms is None else TAGS[algorithms[i]], amount, window, bursts[i]]
            if type(op) is Settle:
                args += [op.deltas[i], op.stamps[i]]
        if type(op) is Hit and op.slots:
            # Concurrency slots (_slots.lua): the slot keys' sets after the counters;
            # the first token (0: the sets' next), the lease, the caps and how many after
            # the counters' arguments.
            args += [0, lease_ms, *op.caps, len(op.slots)]
            keys = [names.counter(k) for k in op.keys] + [names.slot(k) for k in op.slots]
            return ("slot_hits", keys, args)
        return ("counters", [names.counter(k) for k in op.keys], args)
    if type(op) is Vacate:
        return ("vacate", [names.slot(k) for k in op.slots], [str(op.token)])
    if type(op) is Lookup:
        return (None, [names.record(op.key)], list(_FIELDS))
    if type(op) is Claim:
        quota = op.quota
        if quota is None or op.reserve <= 0:
            return ("claim", [names.record(op.key)], [lease_ms])
        return (
            "claim",
            books(names, op.key, op.scope, op.client),
            [lease_ms, op.reserve, quota.scope_bytes, quota.client_bytes, quota.total_bytes],
        )
    if type(op) is Save:
        quota = op.quota if op.quota is not None else _DEFAULT_QUOTA
        response = op.response
        return (
            "save",
            books(names, op.key, op.scope, op.client),
            [
                str(op.token),
                response.digest,
                response.status,
                _encode_headers(join_parts(response.headers, response.parts)),
                response.body,
                max(1, math.ceil(op.ttl * 1000)),
                quota.scope_bytes,
                quota.client_bytes,
                quota.total_bytes,
                *wake(names, op.key),
                op.size,
                publish(names),
            ],
        )
    if type(op) is Release:
        return release(names, op.key, op.scope, op.client, op.token)
    raise StoreError(f"the Redis store cannot apply {type(op).__name__}")


def books(names: KeyNames, key: str, scope: str, client: str) -> list[bytes]:
    """The record of ``key`` and the quota books a claim, save or release script takes:
    its scope's, client's and the store's; on a Cluster its scope's only, if it is in the
    record's slot (the others are taken apart: cluster.py)."""
    if names.cluster:
        if names.same_slot(key, scope):
            return [names.record(key), *names.scope(scope)]
        return [names.record(key)]
    return names.buckets(key, scope, client)


def wake(names: KeyNames, key: str) -> tuple[bytes, str]:
    """Where a Save or Release of ``key`` publishes, and what it says: the key itself."""
    return (names.wake(key) if names.cluster else names.channel), key


def publish(names: KeyNames) -> str:
    # A Cluster's scripts publish on a shard channel of their record's slot (SPUBLISH).
    return "S" if names.cluster else ""


def release(names: KeyNames, key: str, scope: str, client: str, token: int) -> Command:
    """The command ending a claim without storing (a Release, or a holder's close)."""
    return (
        "release",
        books(names, key, scope, client),
        [str(token), *wake(names, key), publish(names)],
    )


def fill_from_reply(
    held: HeldLeases,
    op: StoreOp,
    result: Any,
    alike: list[Hit] | None = None,
    wall: float | None = None,
) -> None:
    """Fill ``op`` in from its command's reply; ``held``: the claims this process holds;
    ``wall``: the decisions' wall time when a test clock took them (None: the server's)."""
    if type(op) is Hit:
        # result: how many of the alike hits were allowed, the time, then per limit its
        # count, previous count and start (or arrival time) before them; for slots, per
        # slot key the requests in flight before them, and the first of their tokens.
        t = float(result[1])
        group = alike if alike is not None else (op,)
        end = 2 + 3 * len(op.keys)
        fill_decided(
            group,
            int(result[0]),
            result[2:end:3],
            result[3:end:3],
            [float(s) for s in result[4:end:3]],
            t,
            t if wall is None else wall,
        )
        if op.slots:
            allowed, first = int(result[0]), int(result[-1])
            tokens = list(range(first, first + allowed))
            fill_slots(group, allowed, [int(n) for n in result[end:-1]], tokens)
            for token in tokens:
                for key in op.slots:
                    held.hold(SLOT, key, token)
    elif type(op) is Vacate:
        for key in op.slots:
            held.end(SLOT, key, op.token)
    elif type(op) is Lookup:
        digest, status, headers, body = result
        op.result = None if digest is None else _stored(digest, status, headers, body)
    elif type(op) is Claim:
        if result[0] == 0:
            op.held = True
            op.retry_after = result[1] / 1000.0
        elif result[0] == 1:
            op.stored = _stored(*result[1:5])
        elif result[0] == 3:  # over a quota: which cap (1 scope, 2 client, 3 total)
            op.over = _BUCKETS[int(result[1]) - 1]
        else:
            op.token = int(result[1])
            held.hold(CLAIM, op.key, op.token)
    elif type(op) is Save:
        text = result.decode() if isinstance(result, bytes) else str(result)
        op.outcome = cast(SaveOutcome, text)  # the script returns one of SaveOutcome's values
        if op.token:
            held.end(CLAIM, op.key, op.token)
    elif type(op) is Release:
        op.released = result == 1
        held.end(CLAIM, op.key, op.token)
