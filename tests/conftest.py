from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from porch.pool import KeyPool
from porch.store.sqlite import SQLiteStore

# Real PostgreSQL / Redis servers for the tests that need them (tests/servers.py).
pytest_plugins = ["servers"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[KeyPool]:
    """Two shards on a new SQLite store in ``tmp_path``, not started (the middleware opens
    it on its first request), closed after the test."""
    p = KeyPool(SQLiteStore(tmp_path), size=2)
    yield p
    await p.close()
