"""A batch of hits only (the limiter's batches): a lean server function and its codec.

``apply_v3`` handles every kind of op; a batch of hits alone pays for its
generality (25 array arguments, ten result columns, steps for claims it
skips). Its row locks are held from the lock to the commit, and a hot
counter's batches queue on its row, so the function's time per call bounds
a hot client's throughput. Measured on one key, sequential calls, against
``apply_v2`` (its predecessor): about a quarter less server CPU per call.
Same rule, same lock order (counters by key), same exactness; one
transaction per call, as ``apply_v3``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..alike import fill_fixed
from ..base import Hit

__all__ = [
    "HITS_FUNCTION",
    "LOCK_COUNTERS",
    "HitArrays",
    "decide_hits",
    "hit_arguments",
    "settle_hits",
]

# The counter step, one SQL text spliced into both functions (hits_v1 here and
# apply_v2 in function.py), so the rule is written once. Inputs (the hits'
# arrays, see HitArrays): ukeys, lidx, lamounts, lwindows, hstart, hmult; the
# caller declares t, nh (the number of hits), cc, cs, ce (count, window start,
# expiry per ukey), a, b, x, sz, has the output columns op, code, counts,
# resets, and an argument prune (how many expired counters to delete at most).

# Rows absent get created first (in key order, before any lock is held), then
# every row is locked in key order and read in the same statement.
LOCK_COUNTERS = r"""
    INSERT INTO counters AS c (key, count, window_start, expires)
        SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
        ON CONFLICT (key) DO NOTHING;
    FOR attempt IN 1 .. 2 LOOP
        SELECT array_agg(l.count ORDER BY u.n), array_agg(l.window_start ORDER BY u.n),
               array_agg(l.expires ORDER BY u.n)
            INTO cc, cs, ce
            FROM unnest(ukeys) WITH ORDINALITY u(k, n)
            JOIN (SELECT x.key, x.count, x.window_start, x.expires FROM counters x
                  WHERE x.key = ANY (ukeys) ORDER BY x.key FOR UPDATE) l ON l.key = u.k;
        EXIT WHEN coalesce(array_length(cc, 1), 0) = array_length(ukeys, 1) OR attempt = 2;
        -- A row pruned between the insert and the lock comes back, locked by its insert.
        INSERT INTO counters AS c (key, count, window_start, expires)
            SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
    END LOOP;
"""


def decide_hits(op: str) -> str:
    """The SQL deciding the locked counters' hits at time t, one output row per hit.

    Each counter row is read once (LOCK_COUNTERS) and written once per batch;
    in between the hits are decided in arrival order on arrays (a refused hit
    consumes nothing). ``op``: the expression numbering hit h's output row.
    """
    return r"""
    FOR h IN 1 .. nh LOOP
        a := hstart[h];
        b := CASE WHEN h < nh THEN hstart[h + 1] - 1 ELSE array_length(lidx, 1) END;
        sz := hmult[h];  -- how many of the m identical hits fit under every limit
        counts := '{}'; resets := '{}';
        FOR j IN a .. b LOOP
            x := lidx[j];
            IF ce[x] <= t THEN  -- a fresh window (an elapsed one is overwritten in place)
                cc[x] := 0; cs[x] := t; ce[x] := t + lwindows[j];
            END IF;
            sz := least(sz, greatest(lamounts[j] - cc[x], 0));
            counts := counts || cc[x];
            resets := resets || (ce[x] - t);
        END LOOP;
        IF sz > 0 THEN
            FOR j IN a .. b LOOP
                cc[lidx[j]] := cc[lidx[j]] + sz;
            END LOOP;
        END IF;
        op := OP; code := sz;
        RETURN NEXT;
    END LOOP;
    UPDATE counters c SET count = u.c, window_start = u.s, expires = u.e
        FROM unnest(ukeys, cc, cs, ce) u(k, c, s, e)
        WHERE c.key = u.k AND c.key = ANY (ukeys);
    -- Bounded pruning piggybacked on writes; never waits for a row another batch holds.
    DELETE FROM counters c WHERE c.key IN (
        SELECT x.key FROM counters x WHERE x.expires <= t
        ORDER BY x.expires LIMIT prune FOR UPDATE SKIP LOCKED);
""".replace("op := OP;", f"op := {op};")


# One output row per hit, in order, plus row 0 with the server time.
HITS_FUNCTION = (
    r"""
CREATE OR REPLACE FUNCTION {s}.hits_v1(
    ukeys text[], lidx int[], lamounts int[], lwindows float8[], hstart int[], hmult int[],
    prune int
) RETURNS TABLE (op int, code int, num float8, counts int[], resets float8[])
LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    t float8;
    nh int := array_length(hstart, 1);
    cc int[];
    cs float8[];
    ce float8[];
    a int;
    b int;
    x int;
    sz int;
BEGIN"""
    + LOCK_COUNTERS
    + r"""
    t := extract(epoch FROM clock_timestamp());
    op := 0; code := 0; num := t;
    RETURN NEXT;
    num := NULL;"""
    + decide_hits("h")
    + r"""END
$fn$;
"""
)


class HitArrays:
    """A batch's hits flattened into the counter step's arrays (as both functions take them).

    The distinct counter keys (``ukeys``, numbered from 1 in order of first
    use), then per limit the number of its key, its amount and window, and per
    hit its first limit and its multiplicity (m alike hits sent as one).
    """

    __slots__ = ("hmult", "hstart", "lamounts", "lidx", "lwindows", "ukeys")

    def __init__(self) -> None:
        self.ukeys: dict[str, int] = {}
        self.lidx: list[int] = []
        self.lamounts: list[int] = []
        self.lwindows: list[float] = []
        self.hstart: list[int] = []
        self.hmult: list[int] = []

    def add(self, hit: Hit, multiplicity: int) -> None:
        lidx = self.lidx
        ukeys = self.ukeys
        self.hstart.append(len(lidx) + 1)
        self.hmult.append(multiplicity)
        for key, amount, window in zip(hit.keys, hit.amounts, hit.windows, strict=True):
            lidx.append(ukeys.setdefault(key, len(ukeys) + 1))
            self.lamounts.append(amount)
            self.lwindows.append(float(window))


def hit_arguments(hits: Sequence[Any], alike: dict[int, list[Hit]], prune: int) -> list[Any]:
    """hits_v1's arguments for a batch of hits (``alike``: see collapse_hits)."""
    arrays = HitArrays()
    for i, hit in enumerate(hits):
        same = alike.get(i)
        arrays.add(hit, 1 if same is None else len(same))
    a = arrays
    return [list(a.ukeys), a.lidx, a.lamounts, a.lwindows, a.hstart, a.hmult, prune]


def settle_hits(hits: Sequence[Any], alike: dict[int, list[Hit]], rows: list[Any]) -> None:
    """Fill in each hit (and the alike hits it stands for) from hits_v1's rows."""
    wall = next(row[2] for row in rows if row[0] == 0)
    for row in rows:
        i = row[0] - 1
        if i < 0:
            continue
        fill_fixed(alike.get(i) or (hits[i],), row[1], row[3], row[4], wall)
