"""Redis away: errors within the timeouts, never a hang; recovery by itself.

(The conformance suite covers a stopped, frozen and restarted server with the
default timeouts; these add what is Redis-specific.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from porch.errors import StoreError
from porch.store.base import Hit
from porch.store.redis import RedisStore
from servers import RedisServer, running_redis

pytestmark = [pytest.mark.redis, pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with running_redis() as s:
        yield s


async def _recovered(store: RedisStore, within: float) -> float:
    """Seconds until an apply succeeds again (polling here is the test's, not porch's)."""
    start = time.monotonic()
    while True:
        try:
            await store.apply([Hit(["recover"], [1_000_000], [3600.0])])
            return time.monotonic() - start
        except StoreError:
            if time.monotonic() - start > within:
                raise
            await asyncio.sleep(0.1)


async def test_batches_queued_behind_a_frozen_server_fail_with_it_then_recover(
    server: RedisServer,
) -> None:
    store = RedisStore(
        server.url, prefix="frozen", connect_timeout=1.0, timeout=1.0, pool_timeout=1.0
    )
    await store.open()
    try:
        server.freeze()
        start = time.monotonic()
        results = await asyncio.gather(
            *(store.apply([Hit([f"k{i}"], [10], [60.0])]) for i in range(8)),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - start
        assert all(isinstance(r, StoreError) for r in results), results
        assert elapsed < 6.0  # a reply timeout, or a pool wait then a reply timeout
        server.thaw()
        assert await _recovered(store, within=15.0) < 15.0
    finally:
        server.thaw()
        await store.close()


async def test_opening_against_a_stopped_server_raises_store_error() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", connect_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(StoreError, match="cannot open Redis store"):
        await store.open()
    assert time.monotonic() - start < 5.0
