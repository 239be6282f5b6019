"""The LISTEN connection's first connect: a watch made before it listens misses nothing.

A store's open() does not wait for its listener (open would hang on it when
the server is slow); a waiter may watch a key before the listener LISTENs, and
the holder's NOTIFY sent in between reaches nobody. So the first connect, like
every reconnect, wakes every watched key once: its waiter claims again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from porch.store.base import Claim, Release
from porch.store.postgres import PostgresStore
from porch.store.postgres.claims import Listen

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

LONG_LEASE = 30.0  # a wake from the lease-end timer would come far too late


async def test_a_watch_made_before_the_listener_listens_is_woken(
    postgres_url: str, schema: str
) -> None:
    holder = PostgresStore(postgres_url, schema=schema, lease=LONG_LEASE)
    waiters = PostgresStore(postgres_url, schema=schema)
    listening = asyncio.Event()
    listen = waiters.claims.channel
    assert isinstance(listen, Listen)
    connect = listen._connect

    async def held_back() -> Any:
        await listening.wait()
        return await connect()

    listen._connect = held_back
    await holder.open()
    await waiters.open()
    try:
        mine = Claim("first")
        await holder.apply([mine])
        held = Claim("first")
        await waiters.apply([held])
        assert held.held
        woken = asyncio.Event()
        waiters.claims.watch("first", woken.set, held.retry_after)
        await holder.apply([Release("first", mine.token)])  # its NOTIFY reaches nobody
        listening.set()
        await asyncio.wait_for(woken.wait(), 10)
        assert waiters.claims.reconnects == 0  # the first connect is not a reconnect
    finally:
        await waiters.close()
        await holder.close()
