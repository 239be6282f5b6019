"""Redis away or a holder gone: errors within the timeouts, never a hang; recovery by itself.

(The conformance suite covers a stopped, frozen and restarted server with the
default timeouts; these add what is Redis-specific.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from porch.errors import StoreError
from porch.store.base import Claim, Hit, Save, StoredResponse
from porch.store.redis import RedisStore
from servers import RedisServer, running_redis

pytestmark = [pytest.mark.redis, pytest.mark.anyio, pytest.mark.slow]

HOLDER = Path(__file__).with_name("redis_holder.py")


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


@pytest.mark.parametrize("how", ["kill -9", "SIGSTOP"])
async def test_another_host_takes_a_dead_or_frozen_holders_key_within_its_lease(
    redis_url: str, how: str
) -> None:
    prefix, key, lease = f"lease{uuid.uuid4().hex[:8]}", "s\x1forder", 1.5
    holder = await asyncio.create_subprocess_exec(
        sys.executable, str(HOLDER), redis_url, prefix, str(lease), key,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdin is not None
    assert holder.stdout is not None
    store = RedisStore(redis_url, prefix=prefix, lease=lease)
    await store.open()
    try:
        old = int(await asyncio.wait_for(holder.stdout.readline(), 30))
        assert old > 0
        first = Claim(key)
        await store.apply([first])
        assert first.held
        assert first.retry_after is not None
        os.kill(holder.pid, signal.SIGKILL if how == "kill -9" else signal.SIGSTOP)
        start = time.monotonic()
        # Wait as the middleware does: a watch (its lease-end timer), then claim again.
        claim = Claim(key)
        while True:
            woke = asyncio.Event()
            store.claims.watch(key, woke.set, claim.retry_after or first.retry_after)
            await asyncio.wait_for(woke.wait(), 10)
            claim = Claim(key)
            await store.apply([claim])
            if not claim.held:
                break
        taken_after = time.monotonic() - start
        assert claim.token > old
        assert taken_after < lease + 2.0
        mine = StoredResponse(b"taker", 201, (), b"from the new owner")
        save = Save(key, mine, 60, token=claim.token)
        await store.apply([save])
        assert save.outcome == "saved"
        if how == "SIGSTOP":
            os.kill(holder.pid, signal.SIGCONT)
            holder.stdin.write(b"save\n")
            await holder.stdin.drain()
            outcome = (await asyncio.wait_for(holder.stdout.readline(), 30)).decode().strip()
            assert outcome == "fenced"
        replay = Claim(key)
        await store.apply([replay])
        assert replay.stored == mine
    finally:
        if holder.returncode is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
        await holder.wait()
        await store.close()
