"""A batch of hits and settles (the limiter's batches): a lean server function and its codec.

``apply_v4`` handles every kind of op; a batch of counter ops alone pays for
its generality (twenty-odd array arguments, eleven result columns, steps for
claims it skips). Its row locks are held from the lock to the commit, and a
hot counter's batches queue on its row, so the function's time per call
bounds a hot client's throughput. ``hits_v2`` is the counter step alone: same
rule, same lock order (counters by key), same exactness; one transaction per
call, as ``apply_v4``.

The counter step decides the policies of docs/design.md ("Policies") in the
spec's IEEE double arithmetic, in its order, as :mod:`porch.store.algorithms`
does in Python: for each hit (or run of alike hits) how many fit every limit,
and each limit's state before them, from which the client computes the
reports with the same functions SQLite uses (:func:`porch.store.alike.fill_decided`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..algorithms import TAGS
from ..alike import fill_decided
from ..base import Hit, Settle

__all__ = [
    "HITS_FUNCTION",
    "LOCK_COUNTERS",
    "CounterArrays",
    "decide_counters",
    "fill_counters",
    "hit_arguments",
]

# The counter step, SQL text spliced into both functions (hits_v2 here and apply_v4 in
# function.py), so the rule is written once. Inputs (see CounterArrays): ukeys, lidx,
# lamounts, lwindows, ltags, lbursts, ldeltas, lstamps, cstart, cmult, ccost; the caller
# declares tc (the counters' time), nc (counter ops), nl (limits), the state arrays cn,
# cp, cs, ce, ca, cd (count, previous count, start or TAT, expiry, algorithm, written)
# per ukey, the scalars below, the output columns op, code, ns, ps, ss, and an argument
# prune (how many expired counters to delete at most).
COUNTER_VARIABLES = r"""
    eps CONSTANT float8 := '1e-9';
    nl int := coalesce(array_length(lidx, 1), 0);
    nc int := coalesce(array_length(cstart, 1), 0);
    cn bigint[];
    cp bigint[];
    cs float8[];
    ce float8[];
    ca int[];
    cd boolean[];
    h int;
    a int;
    b int;
    x int;
    xg int;
    xw float8;
    xa bigint;
    xc bigint;
    xd bigint;
    xk bigint;
    xj bigint;
    xn bigint;
    xp bigint;
    xs float8;
    xt float8;
    xi float8;
"""

# Rows absent get created first (in key order, before any lock is held), then every row
# is locked in key order and read in the same statement.
LOCK_COUNTERS = r"""
    INSERT INTO counters AS c (key, count, window_start, expires)
        SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
        ON CONFLICT (key) DO NOTHING;
    FOR attempt IN 1 .. 2 LOOP
        SELECT array_agg(l.count ORDER BY u.n), array_agg(l.previous ORDER BY u.n),
               array_agg(l.window_start ORDER BY u.n), array_agg(l.expires ORDER BY u.n),
               array_agg(l.algorithm ORDER BY u.n)
            INTO cn, cp, cs, ce, ca
            FROM unnest(ukeys) WITH ORDINALITY u(k, n)
            JOIN (SELECT x.key, x.count, x.previous, x.window_start, x.expires, x.algorithm
                  FROM counters x WHERE x.key = ANY (ukeys) ORDER BY x.key FOR UPDATE) l
                ON l.key = u.k;
        EXIT WHEN coalesce(array_length(cn, 1), 0) = array_length(ukeys, 1) OR attempt = 2;
        -- A row pruned between the insert and the lock comes back, locked by its insert.
        INSERT INTO counters AS c (key, count, window_start, expires)
            SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
    END LOOP;
    cd := array_fill(false, ARRAY[array_length(ukeys, 1)]);
"""

# The state (xn, xp, xs) of counter x as limit j sees it at tc (algorithms.read): a row
# that is absent, expired or another algorithm's is read as absent; an elapsed window rolls.
_READ = r"""
            x := lidx[j]; xg := coalesce(ltags[j], 0); xw := lwindows[j]; xa := lamounts[j];
            IF ca[x] <> xg OR tc >= ce[x] THEN
                xn := 0; xp := 0; xs := tc;
            ELSIF xg = 0 THEN
                IF tc >= cs[x] + xw THEN
                    xn := 0; xp := 0; xs := tc;
                ELSE
                    xn := cn[x]; xp := 0; xs := cs[x];
                END IF;
            ELSIF xg = 1 THEN
                IF tc >= cs[x] + 2 * xw THEN
                    xn := 0; xp := 0; xs := tc;
                ELSIF tc >= cs[x] + xw THEN
                    xn := 0; xp := cn[x]; xs := cs[x] + xw;
                ELSE
                    xn := cn[x]; xp := cp[x]; xs := cs[x];
                END IF;
            ELSE  -- gcra: tat = max(s, t)
                xn := 0; xp := 0; xs := CASE WHEN cs[x] > tc THEN cs[x] ELSE tc END;
            END IF;
"""

# Write (xn, xp, xs) to counter x with its expiry (algorithms.expiry).
_WRITE = r"""
            cn[x] := xn; cp[x] := xp; cs[x] := xs; ca[x] := xg; cd[x] := true;
            ce[x] := CASE xg WHEN 0 THEN xs + xw WHEN 1 THEN xs + 2 * xw ELSE xs END;
"""


def decide_counters(op: str, admit: str = "", admitted: str = "") -> str:
    """The SQL deciding the locked counters' hits and settles at time tc, in arrival
    order, one output row per hit (a refused hit consumes nothing; a settle has no row).

    Each counter row is read once (LOCK_COUNTERS) and written once per batch; in
    between everything is decided on arrays. A hit's row: how many of its alike hits
    fit every limit in turn (code), and per limit the state before them (ns, ps, ss).
    ``op``: the expression numbering counter op h's output row. ``admit``: SQL run for
    hit h before its limits are read, which may lower ``xk`` (how many of its alike
    hits the limits are asked about; concurrency slots, postgres/slots.py);
    ``admitted``: SQL run once ``xk`` of them are counted, before the hit's row.
    """
    return (
        (
            r"""
    IF ltags IS NULL AND ldeltas IS NULL THEN
    -- Fixed windows only, hits only (the common batch): the general loop below, less
    -- what it does for other algorithms and settles, in fewer statements a limit.
    FOR h IN 1 .. nc LOOP
        a := cstart[h];
        b := CASE WHEN h < nc THEN cstart[h + 1] - 1 ELSE nl END;
        xc := coalesce(ccost[h], 1);
        xk := cmult[h];ADMIT
        ns := '{}'; ss := '{}';
        FOR j IN a .. b LOOP
            x := lidx[j];
            -- A fresh window replaces the row's state here, but is written only if a
            -- hit is counted in it (cd): a refused hit writes nothing, and what a later
            -- hit of this batch reads is the same either way.
            IF ca[x] <> 0 OR tc >= ce[x] OR tc >= cs[x] + lwindows[j] THEN
                cn[x] := 0; cp[x] := 0; cs[x] := tc; ce[x] := tc + lwindows[j]; ca[x] := 0;
            END IF;
            ns := ns || cn[x]; ss := ss || cs[x];
            IF cn[x] + xk * xc > lamounts[j] THEN  -- n + c <= A, n growing by c a hit
                xk := CASE WHEN xc = 0 THEN 0 ELSE greatest(0, (lamounts[j] - cn[x]) / xc) END;
            END IF;
        END LOOP;
        IF xk > 0 THEN
            FOR j IN a .. b LOOP
                x := lidx[j]; cn[x] := cn[x] + xk * xc; ce[x] := cs[x] + lwindows[j];
                cd[x] := true;
            END LOOP;
        END IF;
ADMITTED        op := OP; code := xk;
        RETURN NEXT;
    END LOOP;
    ELSE
    FOR h IN 1 .. nc LOOP
        a := cstart[h];
        b := CASE WHEN h < nc THEN cstart[h + 1] - 1 ELSE nl END;
        IF cmult[h] = 0 THEN  -- a settle (algorithms.settle): never refuses
            FOR j IN a .. b LOOP
                xd := ldeltas[j];
                CONTINUE WHEN xd = 0;"""
            + _READ
            + r"""
                IF xg = 2 THEN
                    xi := xw / xa::float8;
                    IF xd > 0 THEN
                        xs := xs + xd * xi;
                    ELSIF xs > tc THEN
                        xt := xs + xd * xi;
                        xs := CASE WHEN xt > tc THEN xt ELSE tc END;
                    ELSE
                        CONTINUE;  -- a refund to a full bucket
                    END IF;
                ELSIF xs = lstamps[j] THEN
                    xn := greatest(0, xn + xd);
                ELSIF xg = 1 AND xs = lstamps[j] + xw THEN  -- now the previous window
                    xp := greatest(0, xp + xd);
                ELSIF xd > 0 THEN  -- a debt follows the client into the current window
                    xn := xn + xd;
                ELSE
                    CONTINUE;  -- a refund to a window that has gone
                END IF;"""
            + _WRITE
            + r"""
            END LOOP;
            CONTINUE;
        END IF;
        xc := coalesce(ccost[h], 1);
        xk := cmult[h];  -- how many of the alike hits fit every limit, in turn
ADMIT
        ns := '{}'; ps := '{}'; ss := '{}';
        FOR j IN a .. b LOOP"""
            + _READ
            + r"""
            ns := ns || xn; ps := ps || xp; ss := ss || xs;
            IF xg = 0 THEN  -- n + c <= A
                IF xc = 0 THEN
                    IF xn > xa THEN xk := 0; END IF;
                ELSIF xn + xk * xc > xa THEN
                    xk := greatest(0, (xa - xn) / xc);
                END IF;
            ELSIF xg = 1 THEN  -- p * w + n + c <= A + EPS, n growing by c a hit
                xt := xp * ((xw - (tc - xs)) / xw);
                xj := 0;
                WHILE xj < xk AND xt + (xn + xj * xc) + xc <= xa + eps LOOP
                    xj := CASE WHEN xc = 0 THEN xk ELSE xj + 1 END;
                END LOOP;
                xk := xj;
            ELSE  -- (tat - t) + c * T <= T * B + EPS * T, tat growing by c * T a hit
                xi := xw / xa::float8;
                xj := 0;
                WHILE xj < xk AND (xs - tc) + xc * xi <= xi * coalesce(lbursts[j], xa) + eps * xi
                LOOP
                    xs := xs + xc * xi;
                    xj := CASE WHEN xc = 0 THEN xk ELSE xj + 1 END;
                END LOOP;
                xk := xj;
            END IF;
        END LOOP;
        IF xk > 0 THEN
            FOR j IN a .. b LOOP
                x := lidx[j]; xg := coalesce(ltags[j], 0); xw := lwindows[j];
                xn := ns[j - a + 1]; xp := ps[j - a + 1]; xs := ss[j - a + 1];
                IF xg = 2 THEN
                    xi := xw / lamounts[j]::float8;
                    FOR i IN 1 .. xk LOOP
                        xs := xs + xc * xi;
                    END LOOP;
                ELSE
                    xn := xn + xk * xc;
                END IF;"""
            + _WRITE
            + r"""
            END LOOP;
        END IF;
ADMITTED        op := OP; code := xk;
        RETURN NEXT;
    END LOOP;
    END IF;
    UPDATE counters c SET count = u.n, previous = u.p, window_start = u.s, expires = u.e,
            algorithm = u.a
        FROM unnest(ukeys, cn, cp, cs, ce, ca, cd) u(k, n, p, s, e, a, d)
        WHERE c.key = u.k AND c.key = ANY (ukeys) AND u.d;
    -- Bounded pruning piggybacked on writes; never waits for a row another batch holds.
    DELETE FROM counters c WHERE c.key IN (
        SELECT x.key FROM counters x WHERE x.expires <= tc
        ORDER BY x.expires LIMIT prune FOR UPDATE SKIP LOCKED);
"""
        )
        .replace("op := OP;", f"op := {op};")
        .replace("ADMITTED", admitted)
        .replace("ADMIT", admit)
    )


_COUNTER_ARGUMENTS = r"""
    ukeys text[], lidx int[], lamounts bigint[], lwindows float8[], ltags int[],
    lbursts bigint[], ldeltas bigint[], lstamps float8[], cstart int[], cmult int[],
    ccost bigint[]"""

# One output row per hit, in order, plus row 0 with the counters' time. The
# counters' time (a test clock's, see PostgresStore(clock=)) is ``tclock``; NULL: the
# server's.
HITS_FUNCTION = (
    r"""
CREATE OR REPLACE FUNCTION {s}.hits_v2("""
    + _COUNTER_ARGUMENTS
    + r""",
    prune int, tclock float8
) RETURNS TABLE (
    op int, code bigint, tok bigint, num float8, ns bigint[], ps bigint[], ss float8[]
)
LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    tc float8;"""
    + COUNTER_VARIABLES
    + r"""
BEGIN"""
    + LOCK_COUNTERS
    + r"""
    tc := coalesce(tclock, extract(epoch FROM clock_timestamp()));
    op := 0; code := 0; num := tc;
    RETURN NEXT;
    num := NULL;"""
    + decide_counters("h")
    + r"""END
$fn$;
"""
)

COUNTER_ARGUMENTS = _COUNTER_ARGUMENTS


class CounterArrays:
    """A batch's hits and settles flattened into the counter step's arrays.

    The distinct counter keys (``ukeys``, numbered from 1 in order of first use),
    then per limit the number of its key, its amount, window, algorithm tag and
    burst, and for a settle its delta and stamp; per counter op its first limit,
    its multiplicity (m alike hits sent as one; 0: a settle) and its cost. Tags,
    bursts, deltas, stamps and costs are sent as NULL until an op needs them (the
    server reads a missing entry as fixed, the amount, nothing, one unit): a batch
    of one-unit fixed-window hits sends what it did before the policies (each
    array more costs the event loop about a microsecond a call in asyncpg).
    """

    __slots__ = (
        "ccost",
        "cmult",
        "cstart",
        "lamounts",
        "lbursts",
        "ldeltas",
        "lidx",
        "lstamps",
        "ltags",
        "lwindows",
        "ukeys",
    )

    def __init__(self) -> None:
        self.ukeys: dict[str, int] = {}
        self.lidx: list[int] = []
        self.lamounts: list[int] = []
        self.lwindows: list[float] = []
        self.ltags: list[int | None] = []
        self.lbursts: list[int | None] = []
        self.ldeltas: list[int | None] = []
        self.lstamps: list[float | None] = []
        self.cstart: list[int] = []
        self.cmult: list[int] = []
        self.ccost: list[int | None] = []

    def add(self, op: Hit | Settle, multiplicity: int) -> None:
        """Add a hit (standing for ``multiplicity`` alike hits) or a settle (0)."""
        lidx = self.lidx
        ukeys = self.ukeys
        first = len(lidx)
        if type(op) is Hit and op.cost != 1:
            _extend(self.ccost, len(self.cstart), (op.cost,))
        self.cstart.append(first + 1)
        self.cmult.append(multiplicity)
        for key, amount, window in zip(op.keys, op.amounts, op.windows, strict=True):
            lidx.append(ukeys.setdefault(key, len(ukeys) + 1))
            self.lamounts.append(amount)
            self.lwindows.append(float(window))
        if op.algorithms is not None:
            _extend(self.ltags, first, [TAGS[a] for a in op.algorithms])
        if op.bursts is not None:
            _extend(self.lbursts, first, op.bursts)
        if type(op) is Settle:
            _extend(self.ldeltas, first, op.deltas)
            _extend(self.lstamps, first, [float(s) for s in op.stamps])

    def arguments(self) -> list[Any]:
        """The counter step's eleven arguments, in order."""
        return [
            list(self.ukeys), self.lidx, self.lamounts, self.lwindows, self.ltags or None,
            self.lbursts or None, self.ldeltas or None, self.lstamps or None, self.cstart,
            self.cmult, self.ccost or None,
        ]  # fmt: skip


def _extend(column: list[Any], first: int, values: Sequence[Any]) -> None:
    """Put ``values`` at positions ``first``.. of a column that may lag behind (None: the
    server's default for the limits before)."""
    if len(column) < first:
        column.extend([None] * (first - len(column)))
    column.extend(values)


def hit_arguments(
    ops: Sequence[Any], alike: dict[int, list[Hit]], prune: int, now: float | None
) -> list[Any]:
    """hits_v2's arguments for a batch of hits and settles (``alike``: see collapse_hits)."""
    arrays = CounterArrays()
    for i, op in enumerate(ops):
        if type(op) is Settle:
            arrays.add(op, 0)
        else:
            same = alike.get(i)
            arrays.add(op, 1 if same is None else len(same))
    return [*arrays.arguments(), prune, now]


def fill_counters(
    ops: Sequence[Any], alike: dict[int, list[Hit]], rows: list[Any], wall: float | None
) -> None:
    """Fill in each hit (and the alike hits it stands for) from the function's rows
    (op, code, tok, num, ns, ps, ss ...: both functions' first columns; row h answers
    ops[h - 1], row 0 carries the counters' time). ``wall``: the decisions' wall time
    (None: that time, the server's)."""
    t = next(row[3] for row in rows if row[0] == 0)
    if wall is None:
        wall = t
    for row in rows:
        i = row[0] - 1
        if i < 0 or type(ops[i]) is not Hit:
            continue
        fill_decided(alike.get(i) or (ops[i],), row[1], row[4], row[5], row[6], t, wall)
