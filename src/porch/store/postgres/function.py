"""The server-side batch function ``<schema>.apply_v4`` and its helpers.

One call decides a whole batch in one transaction: see store.py for the
protocol and schema.py for the tables it works on. ``apply_v4`` is
``apply_v3`` with the policies' counter step (hits.py: algorithms, costs,
settles; each hit answers its limits' state) and a test clock for the
counters: its counter arrays and result columns changed. Hosts of two porch
versions share a schema during an upgrade, each calling its own function, so
a changed interface is a new name; ``apply_v3`` and ``hits_v1`` (and before
them ``apply_v2``, ``prune_responses``) stay as the versions before created them.
"""

from __future__ import annotations

from .hits import COUNTER_ARGUMENTS, COUNTER_VARIABLES, LOCK_COUNTERS, decide_counters

__all__ = ["APPLY_FUNCTION"]

# Which cap sz more bytes for op i would pass (over: 1 the scope's, 2 the client's, 3 the
# total; 0 none): the usage committed, plus this batch's changes (chs, chc, chb). Each
# figure is read once a batch, when first needed (a sum over its 64 slots), and kept up
# to date with the batch's changes from then on, folded in from chb[seen]: a statement
# and a function call per check cost half the server's time on a first execution (a
# claim and a save, each checked; measured, idem-first-postgres). A refusal reclaims
# expired responses and dead holders' reservations still counted (never waiting; once
# per batch), then reads the figures again and looks again.
_OVER = r"""
                LOOP
                    IF qt IS NULL THEN  -- the batch's first check, or its first after a prune
                        qt := coalesce((SELECT sum(z.bytes) FROM usage_total z), 0)
                            + coalesce((SELECT sum(u.b) FROM unnest(chb) u(b)), 0);
                        seen := cardinality(chb);
                    END IF;
                    FOR ci IN seen + 1 .. cardinality(chb) LOOP
                        p := array_position(qs, chs[ci]);
                        IF p IS NOT NULL THEN
                            qsu[p] := qsu[p] + chb[ci];
                        END IF;
                        p := array_position(qc, chc[ci]);
                        IF p IS NOT NULL THEN
                            qcu[p] := qcu[p] + chb[ci];
                        END IF;
                        qt := qt + chb[ci];
                    END LOOP;
                    seen := cardinality(chb);
                    p := array_position(qs, scopes[i]);
                    IF p IS NULL THEN
                        qs := qs || scopes[i];
                        qsu := qsu || (
                            coalesce((SELECT sum(g.bytes) FROM usage g
                                      WHERE g.scope = scopes[i]), 0)
                            + coalesce((SELECT sum(u.b) FROM unnest(chs, chb) u(s, b)
                                        WHERE u.s = scopes[i]), 0));
                        p := cardinality(qs);
                    END IF;
                    over := CASE WHEN qsu[p] + sz > scope_caps[i] THEN 1 ELSE 0 END;
                    IF over = 0 THEN
                        p := array_position(qc, clients[i]);
                        IF p IS NULL THEN
                            qc := qc || clients[i];
                            qcu := qcu || (
                                coalesce((SELECT sum(g.bytes) FROM client_usage g
                                          WHERE g.client = clients[i]), 0)
                                + coalesce((SELECT sum(u.b) FROM unnest(chc, chb) u(c, b)
                                            WHERE u.c = clients[i]), 0));
                            p := cardinality(qc);
                        END IF;
                        over := CASE WHEN qcu[p] + sz > client_caps[i] THEN 2
                                     WHEN qt + sz > total_caps[i] THEN 3 ELSE 0 END;
                    END IF;
                    EXIT WHEN over = 0 OR pruned;
                    pruned := true;
                    PERFORM prune_responses_v2(t, myslot, k, NULL, NULL, 4096);
                    PERFORM prune_claims_v1(t, myslot, k, NULL, NULL, 4096);
                    qs := '{}'; qsu := '{}'; qc := '{}'; qcu := '{}'; qt := NULL;
                END LOOP;"""

# The batch function is code, not data: every open creates (or replaces) it.
# Its name carries its interface version, so hosts of two porch versions
# sharing one schema during an upgrade each call their own.
# Inputs are parallel arrays, one entry per op (kind 1 hit, 2 lookup, 3 claim,
# 4 save, 5 release, 6 renew, 7 settle); the counter ops' limits come flattened
# (hits.py's counter step, CounterArrays), hops numbering each counter op's op.
# One output row per op but settles; op 0 carries the counters' time. A hit's
# row says how many of its alike hits were allowed (code) and each limit's state
# before them (ns, ps, ss). ``tclock``: the counters' time from a test clock (NULL:
# the server's); claims, leases and stored responses always run on the server's.
#
# Stored bytes: a stored response's row counts its size for its scope, its client
# and the total; so does a claim's row while it holds a reservation (status NULL,
# a lease, size = the bytes reserved). Every change a batch makes is appended to
# three arrays (scope, client, bytes) and written once at its end, through the one
# usage slot it locked: usage (per scope), client_usage, usage_total.
APPLY_FUNCTION = (
    r"""
-- PL/pgSQL, not SQL: its statements' plans are cached for the session. Every
-- function's planner settings are schema.py's PLANNER: generic plans, no
-- sequential scans, no JIT.

-- Delete up to n expired stored responses (of one scope or client, or any), skipping
-- rows another batch holds, and take their bytes off through the caller's slot;
-- return how many were deleted. The caller holds slot sl (locked first).
CREATE OR REPLACE FUNCTION {s}.prune_responses_v2(
    t float8, sl int, keep text, sc text, cl text, n int
) RETURNS bigint LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    deleted bigint;
BEGIN
    WITH d AS (
        DELETE FROM records r WHERE r.key IN (
            SELECT x.key FROM records x
            WHERE x.status IS NOT NULL AND x.expires <= t
              AND (x.lease_until IS NULL OR x.lease_until <= t)
              AND (sc IS NULL OR x.scope = sc) AND (cl IS NULL OR x.client = cl)
              AND x.key IS DISTINCT FROM keep
            ORDER BY x.expires LIMIT n FOR UPDATE SKIP LOCKED)
        RETURNING r.scope, r.client, r.size
    ), g AS (
        INSERT INTO usage AS u (scope, slot, bytes)
            SELECT d.scope, sl, -sum(d.size) FROM d WHERE d.scope IS NOT NULL GROUP BY d.scope
            ON CONFLICT (scope, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    ), c AS (
        INSERT INTO client_usage AS u (client, slot, bytes)
            SELECT d.client, sl, -sum(d.size) FROM d WHERE d.client IS NOT NULL
            GROUP BY d.client
            ON CONFLICT (client, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    ), z AS (
        UPDATE usage_total SET bytes = bytes - (SELECT coalesce(sum(d.size), 0) FROM d)
            WHERE slot = sl
    )
    SELECT count(*) INTO deleted FROM d;
    RETURN deleted;
END
$fn$;

-- Delete up to n claims whose lease ended at or before t and nobody took over (their
-- holder died), of one scope or client or any, freeing their reservations.
CREATE OR REPLACE FUNCTION {s}.prune_claims_v1(
    t float8, sl int, keep text, sc text, cl text, n int
) RETURNS bigint LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    deleted bigint;
BEGIN
    WITH d AS (
        DELETE FROM records r WHERE r.key IN (
            SELECT x.key FROM records x
            WHERE x.status IS NULL AND x.lease_until <= t
              AND (sc IS NULL OR x.scope = sc) AND (cl IS NULL OR x.client = cl)
              AND x.key IS DISTINCT FROM keep
            ORDER BY x.lease_until LIMIT n FOR UPDATE SKIP LOCKED)
        RETURNING r.scope, r.client, r.size
    ), g AS (
        INSERT INTO usage AS u (scope, slot, bytes)
            SELECT d.scope, sl, -sum(d.size) FROM d WHERE d.scope IS NOT NULL AND d.size <> 0
            GROUP BY d.scope
            ON CONFLICT (scope, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    ), c AS (
        INSERT INTO client_usage AS u (client, slot, bytes)
            SELECT d.client, sl, -sum(d.size) FROM d WHERE d.client IS NOT NULL AND d.size <> 0
            GROUP BY d.client
            ON CONFLICT (client, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    ), z AS (
        UPDATE usage_total SET bytes = bytes - (SELECT coalesce(sum(d.size), 0) FROM d)
            WHERE slot = sl
    )
    SELECT count(*) INTO deleted FROM d;
    RETURN deleted;
END
$fn$;

CREATE OR REPLACE FUNCTION {s}.apply_v4(
    kinds int[], keys text[],"""
    + COUNTER_ARGUMENTS
    + r""", hops int[],
    tokens bigint[], digests bytea[], statuses int[], headers text[], bodies bytea[],
    ttls float8[], scopes text[], scope_caps bigint[], total_caps bigint[],
    lease float8, prune int, channel text,
    clients text[], client_caps bigint[], reserves bigint[], sizes bigint[], tclock float8
) RETURNS TABLE (
    op int, code bigint, tok bigint, num float8, ns bigint[], ps bigint[], ss float8[],
    r_digest bytea, r_status int, r_headers text, r_body bytea
) LANGUAGE plpgsql SET search_path = {s}, pg_catalog
    {planner} AS $fn$
DECLARE
    n int := coalesce(array_length(kinds, 1), 0);
    rkeys text[];
    t float8;
    tc float8;"""
    + COUNTER_VARIABLES
    + r"""
    i int;
    k text;
    rec record;
    sz bigint;
    old bigint;
    myslot int;
    saved boolean := false;
    pruned boolean := false;
    over int;
    done boolean[] := array_fill(false, ARRAY[n]);
    ckeys text[];
    cidx int[];
    wkeys text[];
    -- The stored bytes this batch changes: one entry per change (scope, client, bytes),
    -- written through its usage slot once, at the end.
    chs text[] := '{}';
    chc text[] := '{}';
    chb bigint[] := '{}';
    -- The caps' view of stored bytes (see _OVER): per scope (qs, qsu), per client (qc,
    -- qcu) and in all (qt), with this batch's changes up to chb[seen] counted in.
    qs text[] := '{}';
    qsu bigint[] := '{}';
    qc text[] := '{}';
    qcu bigint[] := '{}';
    qt bigint;
    seen int := 0;
    p int;
    ci int;
    nkeys text[] := '{}';
    claims boolean := nc < n;  -- anything but counter ops (a batch of them skips these steps)
BEGIN
    -- Every table is reached through its key index (= ANY, or LATERAL per key):
    -- a join against an array would let the planner scan a whole table.
    IF claims THEN
    SELECT array_agg(keys[j]) FILTER (WHERE kinds[j] = 3),
           array_agg(j) FILTER (WHERE kinds[j] = 3),
           coalesce(array_agg(keys[j]) FILTER (WHERE kinds[j] IN (4, 5, 6)), '{}')
        INTO ckeys, cidx, wkeys
        FROM generate_subscripts(kinds, 1) j;
    -- Replays first: a claim whose key holds a live stored response and no live
    -- claim is answered without a lock (a stored response changes only once it
    -- expired), so a batch of replays writes nothing and its commit does not
    -- wait for a WAL flush. Keys this batch also saves or releases are left to
    -- the ordered pass below.
    t := extract(epoch FROM clock_timestamp());
    FOR rec IN
        SELECT u.j, r.digest, r.status, r.headers, r.body
        FROM unnest(ckeys, cidx) u(k, j)
        -- LIMIT 1 (the key is unique): a lookup per key, never a join the planner may
        -- turn around into a scan of every live response.
        CROSS JOIN LATERAL (SELECT x.* FROM records x WHERE x.key = u.k LIMIT 1) r
        WHERE r.status IS NOT NULL AND r.expires > t
          AND (r.lease_until IS NULL OR r.lease_until <= t)
          AND NOT (u.k = ANY (wkeys))
    LOOP
        done[rec.j] := true;
        op := rec.j; code := 1; num := NULL; tok := NULL;
        r_digest := rec.digest; r_status := rec.status;
        r_headers := rec.headers; r_body := rec.body;
        RETURN NEXT;
    END LOOP;
    IF NOT (false = ANY (done)) THEN  -- replays only: nothing to lock, nothing written
        RETURN;
    END IF;
    END IF;

    -- Lock phase, always in one global order (a usage slot, counters, records),
    -- rows by key: concurrent batches never deadlock. The slot comes first and
    -- is taken only by batches that may change stored bytes (claims, saves and
    -- releases; not replays, not renewals).
    IF claims AND EXISTS (SELECT 1 FROM generate_subscripts(kinds, 1) j
                          WHERE kinds[j] IN (3, 4, 5) AND NOT done[j]) THEN
        SELECT z.slot INTO myslot FROM usage_total z
            ORDER BY (z.slot + pg_backend_pid()) % 64 LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF myslot IS NULL THEN  -- all 64 busy: queue for one, holding nothing else yet
            SELECT z.slot INTO myslot FROM usage_total z
                WHERE z.slot = pg_backend_pid() % 64 FOR UPDATE;
        END IF;
    END IF;
    IF nc > 0 THEN"""
    + LOCK_COUNTERS
    + r"""
    END IF;
    IF claims THEN
        SELECT array_agg(DISTINCT keys[j]) INTO rkeys
            FROM generate_subscripts(kinds, 1) j WHERE kinds[j] BETWEEN 3 AND 6 AND NOT done[j];
    END IF;
    IF rkeys IS NOT NULL THEN
        -- An absent key gets an empty row first, so that two hosts claiming a new
        -- key at once queue on one row lock instead of both finding nothing.
        INSERT INTO records AS r (key)
            SELECT u.k FROM unnest(rkeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
        PERFORM 1 FROM records r WHERE r.key = ANY (rkeys) ORDER BY r.key FOR UPDATE;
        INSERT INTO records AS r (key)
            SELECT u.k FROM unnest(rkeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
    END IF;
    t := extract(epoch FROM clock_timestamp());
    tc := coalesce(tclock, t);

    op := 0; code := 0; num := tc;
    RETURN NEXT;
    num := NULL; tok := NULL; r_digest := NULL; r_status := NULL; r_headers := NULL; r_body := NULL;

    -- Hits and settles (the counter rows were locked and read above).
    IF nc > 0 THEN"""
    + decide_counters("hops[h]")
    + r"""
        ns := NULL; ps := NULL; ss := NULL;
    END IF;

    FOR i IN 1 .. CASE WHEN claims THEN n ELSE 0 END LOOP
        CONTINUE WHEN done[i];  -- a replay, answered first
        op := i; code := 0; tok := NULL; num := NULL;
        r_digest := NULL; r_status := NULL; r_headers := NULL; r_body := NULL;
        k := keys[i];
        CASE kinds[i]
        WHEN 1, 7 THEN  -- a hit or a settle: done above
            CONTINUE;
        WHEN 2 THEN  -- lookup: a live stored response, no lock
            SELECT r.digest, r.status, r.headers, r.body INTO r_digest, r_status, r_headers, r_body
                FROM records r WHERE r.key = k AND r.status IS NOT NULL AND r.expires > t;
            code := (r_status IS NOT NULL)::int;
        WHEN 3 THEN  -- claim: held elsewhere (2), stored (1), taken (3), over a quota (4)
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF FOUND AND rec.lease_until IS NOT NULL AND rec.lease_until > t THEN
                code := 2; num := rec.lease_until - t;
            ELSIF FOUND AND rec.status IS NOT NULL AND rec.expires > t THEN
                code := 1;
                r_digest := rec.digest; r_status := rec.status;
                r_headers := rec.headers; r_body := rec.body;
            ELSE
                -- An expired response, or a lapsed claim's reservation: its bytes go
                -- (pruned when touched).
                old := CASE WHEN FOUND THEN rec.size ELSE 0 END;
                IF old <> 0 THEN
                    chs := chs || rec.scope; chc := chc || rec.client; chb := chb || -old;
                END IF;
                over := 0;
                IF reserves[i] > 0 THEN
                    sz := reserves[i];"""
    + _OVER
    + r"""
                END IF;
                IF over <> 0 THEN
                    -- Nothing taken: the row stays as it was, its bytes counted again.
                    IF old <> 0 THEN
                        chs := chs || rec.scope; chc := chc || rec.client; chb := chb || old;
                    END IF;
                    code := 4; num := over;
                ELSE
                    tok := nextval('tokens');
                    sz := greatest(reserves[i], 0);
                    INSERT INTO records AS r (key, token, lease_until, scope, client, size)
                        VALUES (k, tok, t + lease, CASE WHEN sz > 0 THEN scopes[i] END,
                            CASE WHEN sz > 0 THEN clients[i] END, sz)
                        ON CONFLICT (key) DO UPDATE SET digest = NULL, status = NULL,
                            headers = NULL, body = NULL, scope = excluded.scope,
                            client = excluded.client, size = excluded.size, expires = NULL,
                            token = excluded.token, lease_until = excluded.lease_until;
                    IF sz > 0 THEN
                        chs := chs || scopes[i]; chc := chc || clients[i]; chb := chb || sz;
                    END IF;
                    code := 3; num := lease;
                END IF;
            END IF;
        WHEN 4 THEN  -- save: saved (1), fenced (2), over quota (3)
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF tokens[i] <> 0
                    AND (NOT FOUND OR rec.token <> tokens[i] OR rec.lease_until IS NULL) THEN
                code := 2;
            ELSE
                sz := sizes[i];
                -- The claim's reservation (or an older response of this key) is replaced.
                old := CASE WHEN FOUND THEN rec.size ELSE 0 END;
                IF old <> 0 THEN
                    chs := chs || rec.scope; chc := chc || rec.client; chb := chb || -old;
                END IF;
"""
    + _OVER
    + r"""
                IF over <> 0 THEN
                    code := 3;
                    IF tokens[i] <> 0 THEN  -- the claim ends, nothing is stored
                        IF rec.status IS NULL THEN
                            DELETE FROM records r WHERE r.key = k;
                        ELSE
                            UPDATE records r SET digest = NULL, status = NULL, headers = NULL,
                                body = NULL, scope = NULL, client = NULL, size = 0,
                                expires = NULL, lease_until = NULL WHERE r.key = k;
                        END IF;
                    ELSIF old <> 0 THEN
                        -- the old response stays: its bytes count again
                        chs := chs || rec.scope; chc := chc || rec.client; chb := chb || old;
                    END IF;
                ELSE
                    code := 1;
                    INSERT INTO records AS r (key, digest, status, headers, body, scope, client,
                            size, expires, token, lease_until)
                        VALUES (k, digests[i], statuses[i], headers[i], bodies[i], scopes[i],
                            clients[i], sz, t + ttls[i], 0, NULL)
                        ON CONFLICT (key) DO UPDATE SET digest = excluded.digest,
                            status = excluded.status, headers = excluded.headers,
                            body = excluded.body, scope = excluded.scope,
                            client = excluded.client, size = excluded.size,
                            expires = excluded.expires,
                            lease_until = CASE WHEN tokens[i] = 0 THEN r.lease_until END;
                    chs := chs || scopes[i]; chc := chc || clients[i]; chb := chb || sz;
                    saved := true;
                END IF;
                nkeys := nkeys || k;
            END IF;
        WHEN 5 THEN  -- release: released (1) or not current (0); its reservation freed
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF FOUND AND rec.token = tokens[i] AND rec.lease_until IS NOT NULL THEN
                IF rec.status IS NULL THEN
                    DELETE FROM records r WHERE r.key = k;
                    IF rec.size <> 0 THEN
                        chs := chs || rec.scope; chc := chc || rec.client; chb := chb || -rec.size;
                    END IF;
                ELSE
                    UPDATE records r SET lease_until = NULL WHERE r.key = k;
                END IF;
                code := 1;
                nkeys := nkeys || k;
            END IF;
        WHEN 6 THEN  -- renew a claim this process holds: renewed (1) or lost (0)
            UPDATE records r SET lease_until = t + lease
                WHERE r.key = k AND r.token = tokens[i] AND r.lease_until IS NOT NULL;
            code := FOUND::int;
        END CASE;
        RETURN NEXT;
    END LOOP;

    IF array_length(chb, 1) > 0 THEN
        INSERT INTO usage AS g (scope, slot, bytes)
            SELECT u.s, myslot, sum(u.b) FROM unnest(chs, chb) u(s, b)
            WHERE u.s IS NOT NULL GROUP BY u.s HAVING sum(u.b) <> 0
            ON CONFLICT (scope, slot) DO UPDATE SET bytes = g.bytes + excluded.bytes;
        INSERT INTO client_usage AS g (client, slot, bytes)
            SELECT u.c, myslot, sum(u.b) FROM unnest(chc, chb) u(c, b)
            WHERE u.c IS NOT NULL GROUP BY u.c HAVING sum(u.b) <> 0
            ON CONFLICT (client, slot) DO UPDATE SET bytes = g.bytes + excluded.bytes;
        UPDATE usage_total SET bytes = bytes + (SELECT sum(u.b) FROM unnest(chb) u(b))
            WHERE slot = myslot;
    END IF;
    IF array_length(nkeys, 1) > 0 THEN  -- sent at commit: waiters elsewhere wake then
        PERFORM pg_notify(channel, md5(convert_to(u.k, 'UTF8'))) FROM unnest(nkeys) u(k);
    END IF;
    IF rkeys IS NOT NULL THEN  -- the empty rows nobody claimed or filled
        DELETE FROM records r
            WHERE r.key = ANY (rkeys) AND r.status IS NULL AND r.lease_until IS NULL;
    END IF;

    -- Bounded pruning piggybacked on writes; never waits for a row another batch holds.
    IF saved THEN
        PERFORM prune_responses_v2(t, myslot, NULL, NULL, NULL, prune);
        -- Claims whose holder died a minute ago and nobody took over: their reservations.
        PERFORM prune_claims_v1(t - 60, myslot, NULL, NULL, NULL, prune);
    END IF;
END
$fn$;
"""
)
