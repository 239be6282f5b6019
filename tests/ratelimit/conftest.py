"""What the rate-limit tests share: a manual clock that the store and the middleware both
read, and a pool over a SQLite store in the test's directory on that clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from porch import KeyPool, ManualClock, SQLiteStore

WALL = 1_700_000_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=500.0, wall=WALL)


@pytest.fixture
async def pool(tmp_path: Path, clock: ManualClock) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path, clock=clock), size=2)
    yield p
    await p.close()
