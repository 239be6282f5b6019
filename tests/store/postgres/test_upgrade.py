"""A rolling upgrade: hosts of the previous release keep deciding on a schema this one migrated.

The previous release (schema 3) calls ``hits_v1`` and ``apply_v3``
(tests/store/postgres/previous.py, verbatim). This one migrates the schema to 4
(the counters' algorithm and previous count) and calls ``hits_v2``/``apply_v4``;
its migration leaves the old functions in place, so while both run, one client
is counted once, on the same rows, by either host.
"""

from __future__ import annotations

from secrets import token_bytes
from typing import Any

import asyncpg
import pytest

from porch.store.base import Hit
from porch.store.postgres import PostgresStore
from porch.store.postgres.schema import _MIGRATIONS, SCHEMA_VERSION, quote_schema
from support import used

from .previous import PREVIOUS_FUNCTIONS

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

KEY = "rl\x1fcheckout\x1f3-per-60s\x1fclient:203.0.113.9"


async def _previous_release(conn: Any, schema: str) -> None:
    """The schema as the previous release created it: migrations 1-3, its functions."""
    s = quote_schema(schema)
    async with conn.transaction():
        await conn.execute(f"CREATE SCHEMA {s}")
        await conn.execute(
            f"CREATE TABLE {s}.migrations (version integer PRIMARY KEY,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for number, migration in enumerate(_MIGRATIONS[:3], 1):
            await conn.execute(migration.format(s=s))
            await conn.execute(f"INSERT INTO {s}.migrations (version) VALUES ($1)", number)
        await conn.execute(
            f"INSERT INTO {s}.meta (name, value) VALUES ('secret', $1)", token_bytes(32)
        )
        for function in PREVIOUS_FUNCTIONS:
            await conn.execute(function.replace("{s}", s))


async def _old_hit(conn: Any, schema: str) -> tuple[int, int]:
    """One hit of the old host's limiter (hits_v1): (allowed of 1, count before it)."""
    rows = await conn.fetch(
        f"SELECT * FROM {quote_schema(schema)}.hits_v1($1, $2, $3, $4, $5, $6, $7)",
        [KEY], [1], [5], [60.0], [1], [1], 64,
    )  # fmt: skip
    (row,) = [r for r in rows if r["op"] == 1]
    return row["code"], row["counts"][0]


async def _old_claim(conn: Any, schema: str, key: str) -> int:
    """A claim (no quota) through the old host's apply_v3: its token."""
    none: list[Any] = [None]
    rows = await conn.fetch(
        f"SELECT * FROM {quote_schema(schema)}.apply_v3("
        + ", ".join(f"${n}" for n in range(1, 26))
        + ")",
        [3], [key], [], [], [], [], [], [], [], none, none, none, none, none, none, none,
        none, none, 3.0, 64, "porch_claims_x", none, none, [0], none,
    )  # fmt: skip
    (row,) = [r for r in rows if r["op"] == 1]
    assert row["code"] == 3
    return int(row["tok"])


async def test_an_old_host_keeps_counting_with_a_new_one_on_the_same_rows(
    postgres_url: str, schema: str
) -> None:
    conn = await asyncpg.connect(postgres_url)
    try:
        await _previous_release(conn, schema)
        assert await _old_hit(conn, schema) == (1, 0)
        assert await _old_hit(conn, schema) == (1, 1)

        new = PostgresStore(postgres_url, schema=schema)
        await new.open()  # migrates 3 -> 4 under the old host
        try:
            versions = await conn.fetch(f'SELECT version FROM "{schema}".migrations')
            assert sorted(r[0] for r in versions) == list(range(1, SCHEMA_VERSION + 1))
            hit = Hit([KEY], [5], [60.0])
            await new.apply([hit])
            assert (hit.allowed, used(hit)) == (True, [3])  # the old host's two, and this
            assert await _old_hit(conn, schema) == (1, 3)  # the new host's count, and on
            hit = Hit([KEY], [5], [60.0])
            await new.apply([hit])
            assert (hit.allowed, used(hit)) == (True, [5])
            assert await _old_hit(conn, schema) == (0, 5)  # refused by both
            hit = Hit([KEY], [5], [60.0])
            await new.apply([hit])
            assert not hit.allowed
            # The old host's claims, through its apply_v3, still take tokens from the
            # shared sequence.
            first = await _old_claim(conn, schema, "scope\x1fkey-1")
            assert await _old_claim(conn, schema, "scope\x1fkey-2") > first
        finally:
            await new.close()
    finally:
        await conn.close()
