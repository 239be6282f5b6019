"""Fixtures for the PostgreSQL-specific tests: a fresh schema per test on the session server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

asyncpg = pytest.importorskip("asyncpg")


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    """A schema name of this test's own, dropped afterwards."""
    name = f"porch_p{uuid.uuid4().hex[:12]}"
    yield name
    conn = await asyncpg.connect(postgres_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        await conn.close()
