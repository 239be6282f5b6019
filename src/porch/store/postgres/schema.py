"""The PostgreSQL schema, its versioned migrations, and the server-side batch function.

Everything lives in one schema (default ``porch``) owned by the connecting
role, so a plain role that owns one database is enough. Applied migrations are
recorded in ``<schema>.migrations``; every released migration stays as it is
and a change is a new one. Concurrent hosts opening the store at once take a
transaction-scoped advisory lock, so exactly one of them migrates.

Times are Unix seconds (``float8``) read from the SERVER's clock inside the
transaction, after the rows are locked: every host decides on the same clock,
whatever its own says. Key columns use the ``"C"`` collation so that the order
rows are locked in (``ORDER BY key``) is plain byte order everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import StoreError

if TYPE_CHECKING:
    from asyncpg import Connection

__all__ = ["SCHEMA_VERSION", "migrate"]

# Each migration is formatted with {s} = the quoted schema name.
_MIGRATIONS: tuple[str, ...] = (
    # 1: counters, idempotency records with claims, byte usage, fence tokens.
    """
    CREATE TABLE {s}.counters (
        key          text COLLATE "C" PRIMARY KEY,
        count        integer NOT NULL,
        window_start float8 NOT NULL,
        expires      float8 NOT NULL
    );
    CREATE INDEX counters_expires ON {s}.counters (expires);
    CREATE TABLE {s}.records (
        key         text COLLATE "C" PRIMARY KEY,
        digest      bytea,
        status      integer,
        headers     text,
        body        bytea,
        scope       text COLLATE "C",
        size        bigint NOT NULL DEFAULT 0,
        expires     float8,
        token       bigint NOT NULL DEFAULT 0,
        lease_until float8
    );
    CREATE INDEX records_expires ON {s}.records (expires) WHERE status IS NOT NULL;
    CREATE INDEX records_scope ON {s}.records (scope, expires) WHERE status IS NOT NULL;
    CREATE INDEX records_leases ON {s}.records (lease_until) WHERE status IS NULL;
    CREATE SEQUENCE {s}.tokens AS bigint;
    CREATE TABLE {s}.usage (
        scope text COLLATE "C" PRIMARY KEY,
        bytes bigint NOT NULL
    );
    -- The store-wide total is spread over slots (total = their sum) so that
    -- concurrent saves do not all queue behind one row lock.
    CREATE TABLE {s}.usage_total (
        slot  integer PRIMARY KEY,
        bytes bigint NOT NULL
    );
    INSERT INTO {s}.usage_total (slot, bytes) SELECT g, 0 FROM generate_series(0, 15) g;
    """,
)

SCHEMA_VERSION = len(_MIGRATIONS)

# The batch function is code, not data: every open creates (or replaces) it.
# Its name carries its interface version, so hosts of two porch versions
# sharing one schema during an upgrade each call their own.
# Inputs are parallel arrays, one entry per op (kind 1 hit, 2 lookup, 3 claim,
# 4 save, 5 release, 6 renew); the hits' limits come flattened: the distinct
# counter keys (ukeys), then per limit the index of its key, its amount and
# window, and per hit its op number and its first limit. One output row per
# op; op 0 carries the server time.
APPLY_FUNCTION = r"""
CREATE OR REPLACE FUNCTION {s}.apply_v1(
    kinds int[], keys text[],
    ukeys text[], lidx int[], lamounts int[], lwindows float8[], hops int[], hstart int[],
    tokens bigint[], digests bytea[], statuses int[], headers text[], bodies bytea[],
    ttls float8[], scopes text[], scope_caps bigint[], total_caps bigint[],
    lease float8, prune int, channel text
) RETURNS TABLE (
    op int, code int, tok bigint, num float8, counts int[], resets float8[],
    r_digest bytea, r_status int, r_headers text, r_body bytea
) LANGUAGE plpgsql SET search_path = {s}, pg_catalog AS $fn$
DECLARE
    n int := coalesce(array_length(kinds, 1), 0);
    rkeys text[];
    uscopes text[];
    t float8;
    i int;
    k text;
    rec record;
    ok boolean;
    sz bigint;
    used bigint;
    myslot int;
    saved boolean := false;
    cc int[];
    cs float8[];
    ce float8[];
    nh int := coalesce(array_length(hops, 1), 0);
    h int;
    a int;
    b int;
    x int;
BEGIN
    -- Lock phase, always in one global order (counters, records, usage rows,
    -- one total slot), each by key: concurrent batches never deadlock.
    IF nh > 0 THEN
        INSERT INTO counters AS c (key, count, window_start, expires)
            SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
        PERFORM 1 FROM counters c WHERE c.key = ANY (ukeys) ORDER BY c.key FOR UPDATE;
        -- A row pruned between the insert and the lock comes back, locked by its insert.
        INSERT INTO counters AS c (key, count, window_start, expires)
            SELECT u.k, 0, 0, 0 FROM unnest(ukeys) u(k) ORDER BY u.k COLLATE "C"
            ON CONFLICT (key) DO NOTHING;
    END IF;
    SELECT array_agg(DISTINCT keys[j]) INTO rkeys
        FROM generate_subscripts(kinds, 1) j WHERE kinds[j] >= 3;
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
    -- Usage rows of the scopes whose bytes this batch may change: saves, and
    -- claims over an expired response. A replay never locks its scope's row.
    SELECT array_agg(DISTINCT x.scope) INTO uscopes FROM (
        SELECT scopes[j] AS scope FROM generate_subscripts(kinds, 1) j WHERE kinds[j] = 4
        UNION ALL SELECT r.scope FROM records r
            WHERE r.key IN (SELECT keys[j] FROM generate_subscripts(kinds, 1) j WHERE kinds[j] = 4)
              AND r.status IS NOT NULL
        UNION ALL SELECT r.scope FROM records r
            WHERE r.key IN (SELECT keys[j] FROM generate_subscripts(kinds, 1) j WHERE kinds[j] = 3)
              AND r.status IS NOT NULL AND r.expires <= t
    ) x WHERE x.scope IS NOT NULL;
    IF uscopes IS NOT NULL THEN
        INSERT INTO usage AS g (scope, bytes) SELECT u.s, 0 FROM unnest(uscopes) u(s)
            ORDER BY u.s COLLATE "C"
            ON CONFLICT (scope) DO NOTHING;
        PERFORM 1 FROM usage g WHERE g.scope = ANY (uscopes) ORDER BY g.scope FOR UPDATE;
        SELECT z.slot INTO myslot FROM usage_total z
            ORDER BY (z.slot + pg_backend_pid()) % 16 LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF myslot IS NULL THEN
            SELECT z.slot INTO myslot FROM usage_total z
                WHERE z.slot = pg_backend_pid() % 16 FOR UPDATE;
        END IF;
    END IF;

    op := 0; code := 0; num := t;
    RETURN NEXT;
    num := NULL; tok := NULL; r_digest := NULL; r_status := NULL; r_headers := NULL; r_body := NULL;

    -- Hits: each counter row is read once and written once per batch; in between
    -- the hits are decided in arrival order on arrays (a refused hit consumes nothing).
    IF nh > 0 THEN
        SELECT array_agg(c.count ORDER BY u.n), array_agg(c.window_start ORDER BY u.n),
               array_agg(c.expires ORDER BY u.n)
            INTO cc, cs, ce
            FROM unnest(ukeys) WITH ORDINALITY u(k, n) JOIN counters c ON c.key = u.k;
        FOR h IN 1 .. nh LOOP
            a := hstart[h];
            b := CASE WHEN h < nh THEN hstart[h + 1] - 1 ELSE array_length(lidx, 1) END;
            ok := true;
            FOR j IN a .. b LOOP
                x := lidx[j];
                IF ce[x] <= t THEN  -- a fresh window (an elapsed one is overwritten in place)
                    cc[x] := 0; cs[x] := t; ce[x] := t + lwindows[j];
                END IF;
                IF cc[x] >= lamounts[j] THEN
                    ok := false;
                END IF;
            END LOOP;
            IF ok THEN
                FOR j IN a .. b LOOP
                    cc[lidx[j]] := cc[lidx[j]] + 1;
                END LOOP;
            END IF;
            counts := '{}'; resets := '{}';
            FOR j IN a .. b LOOP
                counts := counts || cc[lidx[j]];
                resets := resets || (ce[lidx[j]] - t);
            END LOOP;
            op := hops[h]; code := ok::int;
            RETURN NEXT;
        END LOOP;
        UPDATE counters c SET count = u.c, window_start = u.s, expires = u.e
            FROM unnest(ukeys, cc, cs, ce) u(k, c, s, e) WHERE c.key = u.k;
        counts := NULL; resets := NULL;
    END IF;

    FOR i IN 1 .. n LOOP
        op := i; code := 0; tok := NULL; num := NULL;
        r_digest := NULL; r_status := NULL; r_headers := NULL; r_body := NULL;
        k := keys[i];
        CASE kinds[i]
        WHEN 1 THEN  -- a hit: answered above
            CONTINUE;
        WHEN 2 THEN  -- lookup: a live stored response, no lock
            SELECT r.digest, r.status, r.headers, r.body INTO r_digest, r_status, r_headers, r_body
                FROM records r WHERE r.key = k AND r.status IS NOT NULL AND r.expires > t;
            code := (r_status IS NOT NULL)::int;
        WHEN 3 THEN  -- claim: held elsewhere (2), stored (1), or taken (3)
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF FOUND AND rec.lease_until IS NOT NULL AND rec.lease_until > t THEN
                code := 2; num := rec.lease_until - t;
            ELSIF FOUND AND rec.status IS NOT NULL AND rec.expires > t THEN
                code := 1;
                r_digest := rec.digest; r_status := rec.status;
                r_headers := rec.headers; r_body := rec.body;
            ELSE
                -- An expired response: pruned when touched.
                IF FOUND AND rec.status IS NOT NULL THEN
                    UPDATE usage SET bytes = bytes - rec.size WHERE scope = rec.scope;
                    UPDATE usage_total SET bytes = bytes - rec.size WHERE slot = myslot;
                END IF;
                tok := nextval('tokens');
                INSERT INTO records AS r (key, token, lease_until) VALUES (k, tok, t + lease)
                    ON CONFLICT (key) DO UPDATE SET digest = NULL, status = NULL, headers = NULL,
                        body = NULL, scope = NULL, size = 0, expires = NULL,
                        token = excluded.token, lease_until = excluded.lease_until;
                code := 3; num := lease;
            END IF;
        WHEN 4 THEN  -- save: saved (1), fenced (2), over quota (3)
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF tokens[i] <> 0
                    AND (NOT FOUND OR rec.token <> tokens[i] OR rec.lease_until IS NULL) THEN
                code := 2;
            ELSE
                sz := octet_length(bodies[i]) + octet_length(headers[i]) + octet_length(digests[i]);
                IF FOUND AND rec.status IS NOT NULL THEN
                    UPDATE usage SET bytes = bytes - rec.size WHERE scope = rec.scope;
                    UPDATE usage_total SET bytes = bytes - rec.size WHERE slot = myslot;
                END IF;
                FOR attempt IN 1 .. 2 LOOP
                    SELECT g.bytes INTO used FROM usage g WHERE g.scope = scopes[i];
                    ok := coalesce(used, 0) + sz <= scope_caps[i]
                        AND (SELECT sum(z.bytes) FROM usage_total z) + sz <= total_caps[i];
                    EXIT WHEN ok OR attempt = 2;
                    -- Expired rows still counted: prune them (never waiting), then look again.
                    WITH d AS (
                        DELETE FROM records r WHERE r.key IN (
                            SELECT x.key FROM records x
                            WHERE x.status IS NOT NULL AND x.expires <= t AND x.key <> k
                              AND (x.lease_until IS NULL OR x.lease_until <= t)
                              AND (x.scope = scopes[i] OR coalesce(used, 0) + sz <= scope_caps[i])
                            ORDER BY x.expires LIMIT 4096 FOR UPDATE SKIP LOCKED)
                        AND (r.scope = scopes[i] OR r.scope IN (SELECT u.scope FROM usage u
                            WHERE u.scope = r.scope FOR UPDATE SKIP LOCKED))
                        RETURNING r.scope, r.size
                    ), s AS (
                        UPDATE usage u SET bytes = u.bytes - d2.b
                        FROM (SELECT d.scope, sum(d.size) b FROM d GROUP BY d.scope) d2
                        WHERE u.scope = d2.scope RETURNING d2.b
                    )
                    UPDATE usage_total SET bytes = bytes - (SELECT coalesce(sum(s.b), 0) FROM s)
                        WHERE slot = myslot;
                END LOOP;
                IF NOT ok THEN
                    code := 3;
                    IF tokens[i] <> 0 THEN  -- the claim ends, nothing is stored
                        IF rec.status IS NULL THEN
                            DELETE FROM records r WHERE r.key = k;
                        ELSE
                            UPDATE records r SET digest = NULL, status = NULL, headers = NULL,
                                body = NULL, scope = NULL, size = 0, expires = NULL,
                                lease_until = NULL WHERE r.key = k;
                        END IF;
                    ELSIF FOUND AND rec.status IS NOT NULL THEN
                        -- usage of the old response was taken off above: put it back
                        UPDATE usage SET bytes = bytes + rec.size WHERE scope = rec.scope;
                        UPDATE usage_total SET bytes = bytes + rec.size WHERE slot = myslot;
                    END IF;
                ELSE
                    code := 1;
                    INSERT INTO records AS r (key, digest, status, headers, body, scope, size,
                            expires, token, lease_until)
                        VALUES (k, digests[i], statuses[i], headers[i], bodies[i], scopes[i], sz,
                            t + ttls[i], 0, NULL)
                        ON CONFLICT (key) DO UPDATE SET digest = excluded.digest,
                            status = excluded.status, headers = excluded.headers,
                            body = excluded.body, scope = excluded.scope, size = excluded.size,
                            expires = excluded.expires,
                            lease_until = CASE WHEN tokens[i] = 0 THEN r.lease_until END;
                    UPDATE usage SET bytes = bytes + sz WHERE scope = scopes[i];
                    UPDATE usage_total SET bytes = bytes + sz WHERE slot = myslot;
                    saved := true;
                END IF;
                PERFORM pg_notify(channel, md5(convert_to(k, 'UTF8')));
            END IF;
        WHEN 5 THEN  -- release: released (1) or not current (0)
            SELECT * INTO rec FROM records r WHERE r.key = k;
            IF FOUND AND rec.token = tokens[i] AND rec.lease_until IS NOT NULL THEN
                IF rec.status IS NULL THEN
                    DELETE FROM records r WHERE r.key = k;
                ELSE
                    UPDATE records r SET lease_until = NULL WHERE r.key = k;
                END IF;
                code := 1;
                PERFORM pg_notify(channel, md5(convert_to(k, 'UTF8')));
            END IF;
        WHEN 6 THEN  -- renew a claim this process holds: renewed (1) or lost (0)
            UPDATE records r SET lease_until = t + lease
                WHERE r.key = k AND r.token = tokens[i] AND r.lease_until IS NOT NULL;
            code := FOUND::int;
        END CASE;
        RETURN NEXT;
    END LOOP;

    IF rkeys IS NOT NULL THEN  -- the empty rows nobody claimed or filled
        DELETE FROM records r
            WHERE r.key = ANY (rkeys) AND r.status IS NULL AND r.lease_until IS NULL;
    END IF;

    -- Bounded pruning piggybacked on writes; never waits for a row another batch holds.
    IF nh > 0 THEN
        DELETE FROM counters c WHERE c.key IN (
            SELECT x.key FROM counters x WHERE x.expires <= t
            ORDER BY x.expires LIMIT prune FOR UPDATE SKIP LOCKED);
    END IF;
    IF saved THEN
        WITH d AS (
            DELETE FROM records r WHERE r.key IN (
                SELECT x.key FROM records x
                WHERE x.status IS NOT NULL AND x.expires <= t
                  AND (x.lease_until IS NULL OR x.lease_until <= t)
                ORDER BY x.expires LIMIT prune FOR UPDATE SKIP LOCKED)
            AND r.scope IN (SELECT u.scope FROM usage u WHERE u.scope = r.scope
                FOR UPDATE SKIP LOCKED)
            RETURNING r.scope, r.size
        ), s AS (
            UPDATE usage u SET bytes = u.bytes - d2.b
            FROM (SELECT d.scope, sum(d.size) b FROM d GROUP BY d.scope) d2
            WHERE u.scope = d2.scope RETURNING d2.b
        )
        UPDATE usage_total SET bytes = bytes - (SELECT coalesce(sum(s.b), 0) FROM s)
            WHERE slot = myslot;
        -- Claims whose holder died and nobody took over.
        DELETE FROM records r WHERE r.key IN (
            SELECT x.key FROM records x WHERE x.status IS NULL AND x.lease_until <= t - 60
            ORDER BY x.lease_until LIMIT prune FOR UPDATE SKIP LOCKED);
    END IF;
END
$fn$;
"""


def quote_schema(schema: str) -> str:
    """The schema as a quoted identifier (validated by the store's constructor)."""
    return '"' + schema.replace('"', '""') + '"'


async def migrate(conn: Connection, schema: str) -> int:
    """Create or upgrade ``schema`` to SCHEMA_VERSION; return the version found before."""
    s = quote_schema(schema)
    async with conn.transaction():
        # One opener migrates; the others wait here, then find nothing to do.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"porch-migrate:{schema}")
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.migrations ("
            " version integer PRIMARY KEY,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        found: Any = await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {s}.migrations")
        version = int(found)
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the PostgreSQL schema {schema!r} has version {version}, newer than this "
                f"porch understands ({SCHEMA_VERSION}); upgrade porch"
            )
        for number in range(version, SCHEMA_VERSION):
            await conn.execute(_MIGRATIONS[number].format(s=s))
            await conn.execute(f"INSERT INTO {s}.migrations (version) VALUES ($1)", number + 1)
        await conn.execute(APPLY_FUNCTION.replace("{s}", s))
    return version
