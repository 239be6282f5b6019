from __future__ import annotations

import pytest

from porch.pool import KeyPool


@pytest.fixture
async def pool(pool: KeyPool) -> KeyPool:
    """The suite's pool, started: the tables exist before a test reads any count."""
    await pool.start()
    return pool
