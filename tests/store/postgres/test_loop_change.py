"""The PostgreSQL store closed after its event loop stopped: quiet, and no connection left open."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from porch import KeyPool, Limit, RateLimitMiddleware, Rule, open_store
from porch.store.postgres import PostgresStore
from porch.store.postgres.claims import Listen
from support import in_thread

pytestmark = pytest.mark.postgres

asyncpg = pytest.importorskip("asyncpg")

DEADLINE = 20.0  # a loaded machine ends a loop in well under a second; a hang is forever


async def connections_named(url: str, name: str, at_most: int) -> int:
    """Connections named ``name``, once at most ``at_most`` (a closed one's backend exits soon)."""
    conn = await asyncpg.connect(url)
    try:
        for _ in range(100):
            count = int(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
                )
            )
            if count <= at_most:
                break
            await asyncio.sleep(0.05)
        return count
    finally:
        await conn.close()


def test_each_loop_change_closes_the_old_connections_quietly(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TestClient without ``with``: every request runs on a loop of its own, then it stops."""
    name = f"porch-loops-{uuid.uuid4().hex[:8]}"
    schema = f"loops_{uuid.uuid4().hex[:12]}"
    store = open_store(postgres_url, schema=schema, connections=2, application_name=name)
    pool = KeyPool(store, size=2)

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app = RateLimitMiddleware(
        Starlette(routes=[Route("/", hello)]), pool=pool, rules=Rule(Limit(100, 60.0))
    )
    client = TestClient(app)
    caplog.set_level(logging.WARNING)
    for _ in range(6):
        assert client.get("/").status_code == 200
    # The last loop's store is still open: its two workers and its listener at most.
    assert asyncio.run(connections_named(postgres_url, name, 3)) <= 3
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []
    asyncio.run(pool.close())  # from yet another loop: quiet too
    assert asyncio.run(connections_named(postgres_url, name, 0)) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class _ListeningAsTheLoopEnds:
    """A LISTEN connection whose LISTEN reply arrives just as its event loop ends."""

    def __init__(self, conn: Any, replied: asyncio.Event) -> None:
        self._conn = conn
        self._replied = replied

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def add_listener(self, channel: str, callback: Any) -> None:
        await self._conn.add_listener(channel, callback)
        # The loop's main coroutine returns now, and the runner cancels every task
        # (once) in the very turn this reply is handed back to the listener.
        self._replied.set()
        await asyncio.sleep(0)


def test_a_loop_that_ends_as_the_listener_starts_listening_ends(postgres_url: str) -> None:
    """The hang of TestClient without ``with``: a loop's end cancels each task once (asyncio.run,
    anyio, a TestClient portal) and waits for all of them. Python 3.11's wait_for swallowed the
    cancel meeting the LISTEN reply, the listener went on to wait for its connection to drop,
    and the loop's end waited for it forever."""
    schema = f"loops_{uuid.uuid4().hex[:12]}"
    store = PostgresStore(postgres_url, schema=schema)
    listen = store.claims.channel
    assert isinstance(listen, Listen)
    connect = listen._connect

    async def main() -> None:
        replied = asyncio.Event()

        async def listening_as_the_loop_ends() -> Any:
            return _ListeningAsTheLoopEnds(await connect(), replied)

        listen._connect = listening_as_the_loop_ends
        await store.open()
        await replied.wait()

    in_thread(lambda: asyncio.run(main()), DEADLINE)
    in_thread(lambda: asyncio.run(store.close()), DEADLINE)  # from another loop, as a pool moves
