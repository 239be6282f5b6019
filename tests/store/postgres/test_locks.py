"""Row locks in one order: a batch's vacates and the heartbeat's renewals never deadlock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from porch.store.base import Vacate
from porch.store.postgres import PostgresStore
from porch.store.postgres.schema import quote_schema
from porch.store.postgres.slots import slot_arguments

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ROWS = 2000  # enough that the two calls overlap for milliseconds


@pytest.fixture
async def connections(postgres_url: str, schema: str) -> AsyncIterator[list[Any]]:
    """Two connections to a migrated schema, each statement under a deadline."""
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    await store.close()
    opened = [await asyncpg.connect(postgres_url, timeout=10, command_timeout=10)]
    opened.append(await asyncpg.connect(postgres_url, timeout=10, command_timeout=10))
    try:
        for conn in opened:
            # A deadlock is found this soon (the default is a second), so a cycle costs
            # the test little; the server's superuser runs the suite.
            await conn.execute("SET deadlock_timeout = '20ms'")
        yield opened
    finally:
        for conn in opened:
            await conn.close(timeout=5)


async def test_vacates_and_renewals_take_slots_in_one_order(
    connections: list[Any], schema: str
) -> None:
    # The heartbeat renews a process's slots in the order it holds them; a batch vacates
    # the slots of the requests that ended, in the order they ended. Given the same rows
    # in opposite orders at once, the two met in the middle: a deadlock each round
    # (the server aborted one call after deadlock_timeout).
    heartbeat, batch = connections
    s = quote_schema(schema)
    keys = [f"k{i:05d}" for i in range(ROWS)]
    deadlocks = 0
    for round_ in range(5):
        tokens = [round_ * ROWS + i + 1 for i in range(ROWS)]
        await heartbeat.execute(
            f"INSERT INTO {s}.slots (key, token, lease_until)"
            " SELECT u.k, u.t, extract(epoch FROM clock_timestamp()) + 60"
            " FROM unnest($1::text[], $2::bigint[]) u(k, t)",
            keys,
            tokens,
        )
        vacates = [Vacate((k,), t) for k, t in reversed(list(zip(keys, tokens, strict=True)))]
        args = slot_arguments(vacates, {}, 3.0, 64, None)
        marks = ", ".join(f"${n}" for n in range(1, len(args) + 1))
        outcomes = await asyncio.gather(
            heartbeat.fetch(f"SELECT * FROM {s}.slot_leases_v1($1, $2, $3)", keys, tokens, 60.0),
            batch.fetch(f"SELECT * FROM {s}.slot_hits_v1({marks})", *args),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, asyncpg.exceptions.DeadlockDetectedError):
                deadlocks += 1
            elif isinstance(outcome, BaseException):
                raise outcome
        renewed = outcomes[0]
        if not isinstance(renewed, BaseException):
            # Each row answers for its place in the arrays, whatever order it was taken in.
            assert sorted(row["n"] for row in renewed) == list(range(1, ROWS + 1))
        left = await heartbeat.fetchval(f"SELECT count(*) FROM {s}.slots")
        assert left == 0 or isinstance(outcomes[1], BaseException)
        await heartbeat.execute(f"DELETE FROM {s}.slots")
    assert deadlocks == 0
