"""The Redis store closed after its event loop stopped (its pool moved to another loop).

Each request of Starlette's TestClient without ``with`` runs on a loop of its
own, which ends after it: the pool then closes the store from the next loop,
where nothing of the old one can be awaited any more.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
import warnings

import pytest
import redis.asyncio

from porch.store.base import Claim
from porch.store.redis import RedisStore
from support import in_thread, wait_until

pytestmark = pytest.mark.redis

DEADLINE = 20.0  # a loaded machine ends a loop in well under a second; a hang is forever


def connected(url: str) -> int:
    """Clients connected to the server, this one's own count included."""

    async def count() -> int:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return len(await client.client_list())
        finally:
            await client.aclose()

    return asyncio.run(count())


def test_close_after_the_loop_stopped_ends_claims_and_leaves_nothing_open(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = f"porch-l{uuid.uuid4().hex[:10]}"
    store = RedisStore(redis_url, prefix=prefix, lease=30.0)
    claim = Claim("s\x1fmoved")
    before = connected(redis_url)

    async def serve() -> None:
        await store.open()
        await store.apply([claim])

    caplog.set_level(logging.WARNING)
    in_thread(lambda: asyncio.run(serve()), DEADLINE)
    assert claim.token
    assert not claim.held
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        in_thread(lambda: asyncio.run(store.close()), DEADLINE)  # another loop, as a pool moves
        gc.collect()
    # The old loop's connections were closed as it ended, not left for the collector.
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    wait_until(lambda: connected(redis_url) <= before, "the store's connections closed")

    async def take() -> Claim:
        other = RedisStore(redis_url, prefix=prefix, lease=30.0)
        await other.open()
        try:
            again = Claim(claim.key)
            await other.apply([again])
            return again
        finally:
            await other.close()

    # Ended by close(), not by its 30 s lease: another process takes the key at once.
    again = in_thread(lambda: asyncio.run(take()), DEADLINE)
    assert not again.held
    assert again.token > claim.token
