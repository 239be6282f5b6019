"""Concurrency slots in PostgreSQL: leases in ``slots``, taken with the hits they cap.

A slot is a row ``(key, token, lease_until)`` of ``<schema>.slots``: one request
of the key in flight, held by the process that took it for as long as its
heartbeat renews the lease (see :mod:`porch.store._leases`: every ``lease / 3``
seconds, in the heartbeat's one round trip, claims and slots together). A key's
requests in flight are its rows whose lease has not ended, on the server's
clock; a process killed (or frozen, or cut off) stops renewing, so its slots
are free ``lease`` seconds after its last renewal at most, and a lapsed slot is
never renewed again (another request may have taken its place).

Hits that take slots go through ``slot_hits_v1``, the counter step of hits.py
with two steps spliced in: after the counter rows are locked, every slot key
of the batch is locked too (a transaction-scoped advisory lock per key, taken
in one global order, after the counters: concurrent batches never deadlock)
and its live slots counted; then, for each hit, the alike hits it stands for
are capped at the free slots *before* its limits are read (a request without a
slot consumes no rate), and the slots of those its limits let through are
inserted *after* (a request a rate limit refuses takes no slot). Vacates
delete their rows first, in (key, token) order, the heartbeat's order too. A
batch that also holds claims or saves sends those to ``apply_v4`` in a second
call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._leases import SLOT, HeldLeases
from ..alike import fill_slots
from ..base import Hit, Settle, Vacate
from .hits import (
    COUNTER_ARGUMENTS,
    COUNTER_VARIABLES,
    LOCK_COUNTERS,
    CounterArrays,
    decide_counters,
    fill_counters,
)

__all__ = ["SLOTS_FUNCTION", "SLOT_LEASES_FUNCTION", "SlotArrays", "fill_slot_hits"]

# After the counters: the vacated rows, then each slot key's advisory lock, in one order
# (a hash collision only makes two keys share a lock), then its live slots. Slot rows
# are always locked in (key, token) order, here and by the heartbeat (slot_leases_v1):
# a batch vacating a request's slot while the heartbeat renews it, each in its own
# order, deadlocked (measured, limiter-concurrency-postgres: PostgreSQL aborted one
# after its deadlock_timeout, and that round's p99 was a second).
_LOCK_SLOTS = r"""
    FOR v IN SELECT u.n FROM unnest(vkeys, vtokens) WITH ORDINALITY u(k, t, n)
            ORDER BY u.k COLLATE "C", u.t LOOP
        DELETE FROM slots s WHERE s.key = vkeys[v] AND s.token = vtokens[v];
    END LOOP;
    FOR sk IN SELECT u.k FROM unnest(skeys) u(k) ORDER BY hashtext(u.k), u.k COLLATE "C" LOOP
        PERFORM pg_advisory_xact_lock(hashtext('porch-slots:{s}'), hashtext(sk));
    END LOOP;
    ts := extract(epoch FROM clock_timestamp());
    IF array_length(skeys, 1) > 0 THEN
        DELETE FROM slots s WHERE s.key = ANY (skeys) AND s.lease_until <= ts;
        SELECT array_agg((SELECT count(*) FROM slots s WHERE s.key = u.k) ORDER BY u.n)
            INTO sused FROM unnest(skeys) WITH ORDINALITY u(k, n);
    END IF;
"""

# Hit h's caps: how many of its alike hits find a free slot under every one of them.
_ADMIT = r"""
        sn := NULL; stok := NULL;
        IF sfirst[h] > 0 THEN
            sn := '{}';
            FOR q IN sfirst[h] .. sfirst[h] + scount[h] - 1 LOOP
                sn := sn || sused[sidx[q]];
                xk := least(xk, greatest(0, scaps[q] - sused[sidx[q]]));
            END LOOP;
        END IF;
"""

# The slots of the xk hits the limits let through: a token each, a row per slot key.
_ADMITTED = r"""
        IF sfirst[h] > 0 AND xk > 0 THEN
            stok := ARRAY(SELECT nextval('tokens') FROM generate_series(1, xk));
            FOR q IN sfirst[h] .. sfirst[h] + scount[h] - 1 LOOP
                INSERT INTO slots (key, token, lease_until)
                    SELECT skeys[sidx[q]], u.t, ts + lease FROM unnest(stok) u(t);
                sused[sidx[q]] := sused[sidx[q]] + xk;
            END LOOP;
        END IF;
"""

SLOT_ARGUMENTS = r"""
    skeys text[], sidx int[], scaps bigint[], sfirst int[], scount int[],
    vkeys text[], vtokens bigint[]"""

# The counter step's rows (op, code, tok, num, ns, ps, ss) plus, for a hit with slots,
# its slot keys' requests in flight before it (sn) and the tokens of those it let in.
SLOTS_FUNCTION = (
    r"""
CREATE OR REPLACE FUNCTION {s}.slot_hits_v1("""
    + COUNTER_ARGUMENTS
    + ","
    + SLOT_ARGUMENTS
    + r""",
    lease float8, prune int, tclock float8
) RETURNS TABLE (
    op int, code bigint, tok bigint, num float8, ns bigint[], ps bigint[], ss float8[],
    sn bigint[], stok bigint[]
)
LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    tc float8;
    ts float8;
    sk text;
    v int;
    sused bigint[];"""
    + COUNTER_VARIABLES
    + r"""
BEGIN
    IF array_length(ukeys, 1) > 0 THEN"""
    + LOCK_COUNTERS
    + r"""
    END IF;"""
    + _LOCK_SLOTS
    + r"""
    tc := coalesce(tclock, ts);
    op := 0; code := 0; num := tc;
    RETURN NEXT;
    num := NULL;"""
    + decide_counters("h", _ADMIT, _ADMITTED)
    + r"""
    -- Slots whose holder died and whose key nobody counted since.
    DELETE FROM slots s WHERE (s.key, s.token) IN (
        SELECT x.key, x.token FROM slots x WHERE x.lease_until <= ts
        ORDER BY x.lease_until LIMIT prune FOR UPDATE SKIP LOCKED);
END
$fn$;
"""
)

# The heartbeat's side: renew slots this process holds (lease: seconds from now), or
# end them (lease NULL). A lapsed slot is not renewed: another request may hold its
# place now. One row per slot, numbered by its place in the arrays: renewed (1) or not
# (0). Rows in (key, token) order, as a batch's vacates (_LOCK_SLOTS).
SLOT_LEASES_FUNCTION = r"""
CREATE OR REPLACE FUNCTION {s}.slot_leases_v1(keys text[], tokens bigint[], lease float8)
RETURNS TABLE (n int, ok bigint)
LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    ts float8 := extract(epoch FROM clock_timestamp());
    q int;
BEGIN
    FOR q IN SELECT u.n FROM unnest(keys, tokens) WITH ORDINALITY u(k, t, n)
            ORDER BY u.k COLLATE "C", u.t LOOP
        IF lease IS NULL THEN
            DELETE FROM slots s WHERE s.key = keys[q] AND s.token = tokens[q];
        ELSE
            UPDATE slots s SET lease_until = ts + lease
                WHERE s.key = keys[q] AND s.token = tokens[q] AND s.lease_until > ts;
        END IF;
        n := q; ok := FOUND::int;
        RETURN NEXT;
    END LOOP;
END
$fn$;
"""


class SlotArrays:
    """A batch's slots flattened beside its counter arrays: the distinct slot keys
    (``skeys``), per cap the number of its key and the cap, per counter op its first
    cap (0: none) and how many; and the vacates' keys and tokens, a pair per slot."""

    __slots__ = ("scaps", "scount", "sfirst", "sidx", "skeys", "vkeys", "vtokens")

    def __init__(self) -> None:
        self.skeys: dict[str, int] = {}
        self.sidx: list[int] = []
        self.scaps: list[int] = []
        self.sfirst: list[int] = []
        self.scount: list[int] = []
        self.vkeys: list[str] = []
        self.vtokens: list[int] = []

    def add(self, op: Hit | Settle) -> None:
        if not isinstance(op, Hit) or not op.slots:
            self.sfirst.append(0)
            self.scount.append(0)
            return
        self.sfirst.append(len(self.sidx) + 1)
        self.scount.append(len(op.slots))
        skeys = self.skeys
        for key, cap in zip(op.slots, op.caps, strict=True):
            self.sidx.append(skeys.setdefault(key, len(skeys) + 1))
            self.scaps.append(cap)

    def vacate(self, op: Vacate) -> None:
        for key in op.slots:
            self.vkeys.append(key)
            self.vtokens.append(op.token)

    def arguments(self) -> list[Any]:
        return [
            list(self.skeys), self.sidx, self.scaps, self.sfirst, self.scount,
            self.vkeys, self.vtokens,
        ]  # fmt: skip


def slot_arguments(
    ops: Sequence[Hit | Settle | Vacate],
    alike: dict[int, list[Hit]],
    lease: float,
    prune: int,
    now: float | None,
) -> list[Any]:
    """slot_hits_v1's arguments for a batch of hits, settles and vacates."""
    counters = CounterArrays()
    slots = SlotArrays()
    for i, op in enumerate(ops):
        if type(op) is Vacate:
            slots.vacate(op)
        elif type(op) is Settle:
            counters.add(op, 0)
            slots.add(op)
        elif type(op) is Hit:
            same = alike.get(i)
            counters.add(op, 1 if same is None else len(same))
            slots.add(op)
    return [*counters.arguments(), *slots.arguments(), lease, prune, now]


def fill_slot_hits(
    ops: Sequence[Hit | Settle | Vacate],
    alike: dict[int, list[Hit]],
    rows: list[Any],
    wall: float | None,
    held: HeldLeases,
) -> None:
    """Fill in each hit from slot_hits_v1's rows (the counter step's columns, then its
    slots'); hold the slots taken and forget the vacated ones (``held``: what the
    heartbeat renews)."""
    counter_ops = [op for op in ops if type(op) is not Vacate]
    counter_alike = _renumbered(ops, alike)
    fill_counters(counter_ops, counter_alike, rows, wall)
    for row in rows:
        i = row[0] - 1
        if i < 0:
            continue
        op = counter_ops[i]
        if type(op) is not Hit or op.slots is None:
            continue
        group = counter_alike.get(i) or (op,)
        tokens = [int(t) for t in row[8] or ()]
        fill_slots(group, int(row[1]), [int(n) for n in row[7]], tokens)
        for token in tokens:
            for key in op.slots:
                held.hold(SLOT, key, token)
    for op in ops:
        if type(op) is Vacate:
            for key in op.slots:
                held.end(SLOT, key, op.token)


def _renumbered(
    ops: Sequence[Hit | Settle | Vacate], alike: dict[int, list[Hit]]
) -> dict[int, list[Hit]]:
    """``alike`` by the position among the counter ops (the vacates left out)."""
    renumbered: dict[int, list[Hit]] = {}
    position = 0
    for i, op in enumerate(ops):
        if type(op) is Vacate:
            continue
        same = alike.get(i)
        if same is not None:
            renumbered[position] = same
        position += 1
    return renumbered
