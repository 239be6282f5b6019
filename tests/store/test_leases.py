"""The lease heartbeat's own behaviour (porch.store._leases), on a real Redis store.

What every lease backend must do with its claims is proven in the conformance
suite (tests/store/conformance/test_leases.py: a blocked loop keeps them, close
ends them, also after the loop ended). Here: what the heartbeat says about a
blocked event loop, which is the same code for PostgreSQL.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from porch.store.base import Claim
from porch.store.redis import RedisStore
from support import until, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

# Half of it, the warning's threshold, is longer than the stall a loaded machine gives a
# test's loop between two awaits, and the heartbeat thread (a renewal every 0.5 s) is
# late by a whole lease only if starved for a second.
LEASE = 1.5


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    prefix = f"porch-l{uuid.uuid4().hex[:10]}"
    owner, other = (RedisStore(redis_url, prefix=prefix, lease=LEASE) for _ in range(2))
    await owner.open()
    await other.open()
    try:
        yield owner, other
    finally:
        await owner.close()
        await other.close()


def _blocked_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "event loop has run nothing" in r.getMessage()
    ]


async def test_a_loop_blocked_past_half_a_lease_is_warned_once_and_the_claim_kept(
    stores: tuple[RedisStore, RedisStore], caplog: pytest.LogCaptureFixture, redis_url: str
) -> None:
    owner, other = stores
    caplog.set_level(logging.INFO, logger="porch.store")
    mine = Claim("s\x1fblocked")
    await owner.apply([mine])
    record = owner.names.record(mine.key)
    server = redis.Redis.from_url(redis_url)

    def lease_end() -> bytes | None:
        """The claim's lease end on the server: each renewal of the heartbeat moves it."""
        return server.hget(record, "l")  # type: ignore[return-value]

    def renewed(since: bytes | None) -> bool:
        return lease_end() != since

    try:
        # A renewal with the loop answering first: a stall of the loop before this point
        # (a loaded machine) is over, and said over, before the block begins.
        await until(functools.partial(renewed, lease_end()), "a renewal")
        await until(lambda: not _blocked_warnings(caplog) or "runs again" in caplog.text)
        caplog.clear()
        # The block: this loop (the owner's) runs nothing until the heartbeat warned,
        # then for two more of its rounds, which find it still blocked and say nothing.
        wait_until(lambda: _blocked_warnings(caplog), "the blocked-loop warning")
        for _ in range(2):
            wait_until(functools.partial(renewed, lease_end()), "a renewal while blocked")
        assert len(_blocked_warnings(caplog)) == 1, caplog.text
    finally:
        server.close()
    theirs = Claim(mine.key)
    await other.apply([theirs])
    assert theirs.held  # kept from the heartbeat thread meanwhile
    # Once the loop runs again, that is said too (at INFO): the episode is over.
    await until(lambda: "event loop runs again" in caplog.text, "the loop said to run again")
