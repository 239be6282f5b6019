"""The PostgreSQL schema and its versioned migrations (the batch function is in function.py).

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

from secrets import token_bytes
from typing import TYPE_CHECKING, Any

from ...errors import StoreError
from ..base import SECRET_BYTES
from .function import APPLY_FUNCTION
from .hits import HITS_FUNCTION
from .slots import SLOT_LEASES_FUNCTION, SLOTS_FUNCTION

if TYPE_CHECKING:
    from asyncpg import Connection

__all__ = ["SCHEMA_VERSION", "migrate", "read_secret"]

# Every batch function's planner settings (its code's {planner}). PL/pgSQL keeps a
# statement's plan for the life of the connection, and a generic plan always: by
# default a statement with array parameters is planned again on every call (measured:
# a quarter of the server's CPU per batch). But a generic plan made while a table was
# small (a new schema, its first batches) scans it whole, and goes on scanning it as
# it grows, until the table is analyzed: measured, a batch of 64 claims spent 3 ms in
# a scan of 2,000 stored responses (tests/store/postgres/test_plans.py). Every
# statement in these functions reaches its rows through an index, so sequential
# scans are off (a table with no index that serves is still scanned). JIT is off: the
# statements touch a few rows each, and a disabled scan's cost would have the planner
# compile them (measured: 100 ms a statement).
PLANNER = "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off"

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
    -- Stored bytes, per scope and in total, spread over 64 slots (a figure is
    -- the sum of its slots). A writing batch takes one slot (SKIP LOCKED) and
    -- writes only that slot's rows, so concurrent saves never queue on a row.
    CREATE TABLE {s}.usage_total (
        slot  integer PRIMARY KEY,
        bytes bigint NOT NULL
    );
    INSERT INTO {s}.usage_total (slot, bytes) SELECT g, 0 FROM generate_series(0, 63) g;
    CREATE TABLE {s}.usage (
        scope text COLLATE "C",
        slot  integer,
        bytes bigint NOT NULL,
        PRIMARY KEY (scope, slot)
    );
    """,
    # 2: the store's secret (Store.secret), 32 random bytes from the OS of the host that
    # creates it (inserted by migrate(), in this migration's transaction).
    """
    CREATE TABLE {s}.meta (
        name  text COLLATE "C" PRIMARY KEY,
        value bytea NOT NULL
    );
    """,
    # 3: quotas per client identity and the reservations of claims (apply_v3). A record
    # names its client; a claim's row holds its reservation in scope, client and size
    # while it lives. client_usage: stored and reserved bytes per client, in 64 slots as
    # usage. Records stored before have no client (they count for scope and total).
    """
    ALTER TABLE {s}.records ADD COLUMN client text COLLATE "C";
    CREATE INDEX records_client ON {s}.records (client, expires) WHERE status IS NOT NULL;
    CREATE TABLE {s}.client_usage (
        client text COLLATE "C",
        slot   integer,
        bytes  bigint NOT NULL,
        PRIMARY KEY (client, slot)
    );
    """,
    # 4: the policies (docs/design.md, "Policies"): a counter's algorithm (0 fixed, 1
    # sliding, 2 gcra) and the previous window's count (sliding). Columns with a
    # constant default rewrite no row, so this takes no time on a big table; the
    # previous release's functions, which write neither column, keep working on it.
    # Counts stay 32-bit: widening them would rewrite the table under an exclusive lock
    # (5.6 s for a million counters, beyond the statement timeout), so a count must
    # stay below 2**31 here.
    """
    ALTER TABLE {s}.counters
        ADD COLUMN algorithm smallint NOT NULL DEFAULT 0,
        ADD COLUMN previous  integer  NOT NULL DEFAULT 0;
    """,
    # 5: bodies streamed in parts (parts.py): a body's row says until when it is kept (a
    # body no record names goes then), its parts go with it.
    """
    CREATE TABLE {s}.bodies (
        id      bigint PRIMARY KEY,
        key     text COLLATE "C" NOT NULL,
        expires float8 NOT NULL
    );
    CREATE INDEX bodies_expires ON {s}.bodies (expires);
    CREATE TABLE {s}.parts (
        body bigint REFERENCES {s}.bodies (id) ON DELETE CASCADE,
        seq  integer,
        data bytea NOT NULL,
        PRIMARY KEY (body, seq)
    );
    """,
    # 6: concurrency slots (slots.py): a row per request in flight under a key, a lease
    # its holder's heartbeat renews; the index finds the lapsed ones to prune.
    """
    CREATE TABLE {s}.slots (
        key         text COLLATE "C" NOT NULL,
        token       bigint NOT NULL,
        lease_until float8 NOT NULL,
        PRIMARY KEY (key, token)
    );
    CREATE INDEX slots_leases ON {s}.slots (lease_until);
    """,
)

SCHEMA_VERSION = len(_MIGRATIONS)
_SECRET_VERSION = 2


async def read_secret(conn: Connection, schema: str) -> bytes:
    """The schema's secret (migration 2)."""
    value: Any = await conn.fetchval(
        f"SELECT value FROM {quote_schema(schema)}.meta WHERE name = 'secret'"
    )
    if value is None:
        raise StoreError(f"the PostgreSQL schema {schema!r} has no secret; it is damaged")
    return bytes(value)


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
            if number + 1 == _SECRET_VERSION:
                await conn.execute(
                    f"INSERT INTO {s}.meta (name, value) VALUES ('secret', $1)",
                    token_bytes(SECRET_BYTES),
                )
            await conn.execute(f"INSERT INTO {s}.migrations (version) VALUES ($1)", number + 1)
        for code in (APPLY_FUNCTION, HITS_FUNCTION, SLOTS_FUNCTION, SLOT_LEASES_FUNCTION):
            await conn.execute(code.replace("{s}", s).replace("{planner}", PLANNER))
    return version
