"""A stopped or frozen PostgreSQL server: StoreError within the timeouts, never a hang; recovery.

Each test here runs its own throwaway server (tests/servers.py), since it stops
or SIGSTOPs it. Bounds are generous (a loaded machine): what is asserted is
"fails within the configured timeouts instead of hanging" and "serves again
without being reopened", not a latency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from porch.errors import StoreError
from porch.store.base import Hit
from porch.store.postgres import PostgresStore
from servers import PostgresServer, running_postgres
from support import used

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]


def _store(url: str, *, lease: float = 3.0) -> PostgresStore:
    return PostgresStore(url, lease=lease, connect_timeout=1.0, statement_timeout=1.5)


DEADLINE = 1.5 + 1.0  # statement_timeout + the client-side margin of apply()
SLACK = 3.0  # a loaded machine


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


async def _hit(store: PostgresStore) -> Hit:
    hit = Hit(["k"], [1000], [600.0])
    await store.apply([hit])
    return hit


async def _served_again(store: PostgresStore, within: float = 30.0) -> Hit:
    deadline = time.monotonic() + within
    while True:
        try:
            return await _hit(store)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_stopped_server_fails_at_once_and_the_store_recovers(
    server: PostgresServer,
) -> None:
    store = _store(server.url)
    await store.open()
    try:
        assert used(await _hit(store)) == [1]
        server.stop()
        for _ in range(3):  # the dropped connection, then refused reconnects
            started = time.monotonic()
            with pytest.raises(StoreError):
                await _hit(store)
            assert time.monotonic() - started < DEADLINE + SLACK
        server.start()
        assert used(await _served_again(store)) == [2]  # the count survived the restart
    finally:
        await store.close()


async def test_a_frozen_server_fails_within_the_timeouts_and_the_store_recovers(
    server: PostgresServer,
) -> None:
    store = _store(server.url)
    await store.open()
    try:
        assert used(await _hit(store)) == [1]
        server.freeze()
        try:
            for _ in range(2):  # an open connection that hangs, then a connect that hangs
                started = time.monotonic()
                with pytest.raises(StoreError):
                    await _hit(store)
                assert time.monotonic() - started < DEADLINE + SLACK
        finally:
            server.thaw()
        hit = await _served_again(store)
        assert used(hit)[0] >= 2  # a batch the frozen server had received may have committed
    finally:
        await store.close()
