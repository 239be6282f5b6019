"""The batch functions reach rows through their indexes, whatever the tables held when a
connection first ran them.

PL/pgSQL caches a statement's plan for the life of its connection, and the functions
force generic plans: a plan made while a table was empty (a new schema, the first
batches) would keep scanning it whole as it grows. Each test runs the function once
on empty tables (its plans made and cached), fills the table without an ANALYZE,
then counts, within one transaction of that same connection, the table's sequential
scans (``pg_stat_xact_user_tables``: this backend's, not yet reported).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest

from porch.store.base import Claim, Hit, Lookup, Quota, Save, StoredResponse
from porch.store.postgres import PostgresStore
from porch.store.postgres.codec import Op, arguments
from porch.store.postgres.hits import hit_arguments
from porch.store.postgres.schema import quote_schema

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ROWS = 5000
WITHIN = 10.0  # seconds: the deadline of each statement of the test's own connection
RESPONSE = StoredResponse(b"d", 201, ((b"content-type", b"text/plain"),), b"x" * 100)


@pytest.fixture
async def conn(postgres_url: str, schema: str) -> AsyncIterator[Any]:
    """A connection of its own to a schema a store created (and closed again)."""
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(postgres_url, timeout=WITHIN, command_timeout=WITHIN)
    try:
        yield conn
    finally:
        await conn.close()


async def _scans_after_growth(
    conn: Any,
    schema: str,
    function: str,
    arity: int,
    table: str,
    fill: str,
    first: Sequence[Any],
    second: Sequence[Any],
) -> tuple[int, int]:
    """Run ``function`` with ``first`` on the empty tables (its plans made and cached),
    add ROWS rows to ``table`` (``fill``: its columns and the SELECT of row ``i``; no
    ANALYZE), then run it with ``second`` in a transaction rolled back: the sequential
    scans of ``table`` meanwhile, and the rows its index scans fetched."""
    s = quote_schema(schema)
    marks = ", ".join(f"${n}" for n in range(1, arity + 1))
    sql = f"SELECT * FROM {s}.{function}({marks})"
    await conn.fetch(sql, *first)
    await conn.execute(f"INSERT INTO {s}.{table} {fill} FROM generate_series(1, $1) i", ROWS)
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.fetch(sql, *second)
        row = await conn.fetchrow(
            "SELECT seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables"
            " WHERE schemaname = $1 AND relname = $2",
            schema,
            table,
        )
        return int(row[0]), int(row[1])
    finally:
        await tx.rollback()


def _batch(tag: str, stored: str) -> list[Op]:
    """A batch of every kind the records see: claims (reserving bytes), a claim of
    ``stored`` (a replay, where it holds a response), saves (and their pruning), a lookup."""
    q = Quota()
    return [
        *(Claim(f"{tag}-{i}", scope="s", client="c", quota=q, reserve=200) for i in range(8)),
        Claim(stored, scope="s", client="c", quota=q, reserve=200),
        *(Save(f"{tag}-s{i}", RESPONSE, 60.0, scope="s", client="c", quota=q) for i in range(4)),
        Lookup(stored),
    ]


async def test_a_batch_of_claims_and_saves_scans_no_records_whole(conn: Any, schema: str) -> None:
    def args(tag: str, stored: str) -> list[Any]:
        return arguments(_batch(tag, stored), {}, 3.0, 64, f"porch_claims_{schema}", None)

    fill = (
        "(key, digest, status, headers, body, size, expires) SELECT 'filler-' || i, '\\x00',"
        " 200, '[]', '\\x00', 0, extract(epoch FROM clock_timestamp()) + 3600"
    )
    first, second = args("first", "first-stored"), args("second", "filler-7")
    scans, fetched = await _scans_after_growth(
        conn, schema, "apply_v4", 31, "records", fill, first, second
    )
    assert scans == 0
    assert fetched < ROWS // 10  # the batch's own rows, never every live response


async def test_a_batch_of_hits_scans_no_counters_whole(conn: Any, schema: str) -> None:
    def args(tag: str, shared: str) -> list[Any]:
        hits = [Hit([f"{tag}-{i}", shared], [10, 1000], [60.0, 60.0]) for i in range(8)]
        return hit_arguments(hits, {}, 64, None)

    fill = (
        "(key, count, window_start, expires)"
        " SELECT 'filler-' || i, 1, 0, extract(epoch FROM clock_timestamp()) + 3600"
    )
    first, second = args("first", "first-shared"), args("second", "filler-3")
    scans, fetched = await _scans_after_growth(
        conn, schema, "hits_v2", 13, "counters", fill, first, second
    )
    assert scans == 0
    assert fetched < ROWS // 10
