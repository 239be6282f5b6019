"""The lease heartbeat's own behaviour (porch.store._leases), on a real Redis store.

What every lease backend must do with its claims is proven in the conformance
suite (tests/store/conformance/test_leases.py: a blocked loop keeps them, close
ends them, also after the loop ended). Here: what the heartbeat says about a
blocked event loop, which is the same code for PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from porch.store.base import Claim
from porch.store.redis import RedisStore

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

LEASE = 0.6


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
    stores: tuple[RedisStore, RedisStore], caplog: pytest.LogCaptureFixture
) -> None:
    owner, other = stores
    caplog.set_level(logging.INFO, logger="porch.store")
    mine = Claim("s\x1fblocked")
    await owner.apply([mine])
    time.sleep(4 * LEASE)  # noqa: ASYNC251 - the owner's loop (this one) runs nothing
    assert len(_blocked_warnings(caplog)) == 1, caplog.text
    theirs = Claim(mine.key)
    await other.apply([theirs])
    assert theirs.held  # kept from the heartbeat thread meanwhile
    # Once the loop runs again, that is said too (at INFO): the episode is over.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while "event loop runs again" not in caplog.text:
        assert loop.time() < deadline, caplog.text
        await asyncio.sleep(0.05)
