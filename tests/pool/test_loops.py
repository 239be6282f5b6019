"""The pool follows the event loop it is used on: test clients and test runners never hang.

Each request of Starlette's TestClient without ``with`` runs on an event loop of
its own that is closed afterwards; each anyio / pytest-asyncio test has its own
loop too. Every request here runs in a thread joined with a deadline, so a hang
fails the test instead of wedging the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from porch import (
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    PoolClosedError,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
    open_store,
)
from porch._types import ASGIApp
from support import in_thread

T = TypeVar("T")
DEADLINE = 30.0  # generous: the machine is shared; a hang is forever


def within(call: Callable[[], T], seconds: float = DEADLINE) -> T:
    """``call()`` in a thread; fail (instead of hanging the suite) if it does not return."""
    return in_thread(call, seconds)


def build(pool: KeyPool, limit: int = 3) -> tuple[ASGIApp, list[int]]:
    """A Starlette app behind both middlewares; ``runs`` counts handler executions."""
    runs: list[int] = []

    async def order(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"order": len(runs), "body": (await request.body()).decode()})

    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"hello": True})

    app = Starlette(routes=[Route("/orders", order, methods=["POST"]), Route("/", hello)])
    guarded = IdempotencyMiddleware(app, pool=pool, rules=IdempotencyRule("/orders"))
    limited = RateLimitMiddleware(guarded, pool=pool, rules=Rule(Limit(limit, 60.0, name="all")))
    return limited, runs


def counted(store: SQLiteStore) -> int:
    """The counters' total, read from the rows."""
    with contextlib.closing(sqlite3.connect(store.path)) as conn:
        return int(conn.execute("SELECT COALESCE(SUM(count), 0) FROM counters").fetchone()[0])


@pytest.fixture
def store() -> SQLiteStore:
    return SQLiteStore.temporary()


def test_testclient_without_with_does_not_hang(store: SQLiteStore) -> None:
    pool = KeyPool(store, size=2)
    app, _ = build(pool, limit=3)
    client = TestClient(app)  # no `with`: every request on a fresh loop, closed after it
    statuses = [within(lambda: client.get("/").status_code) for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    assert counted(store) == 3


def test_replay_across_loops_is_byte_identical(store: SQLiteStore) -> None:
    pool = KeyPool(store, size=2)
    app, runs = build(pool, limit=100)
    client = TestClient(app)
    headers = {"Idempotency-Key": "order-1", "Authorization": "Bearer alice"}
    first = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    second = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    assert first.status_code == second.status_code == 200
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert len(runs) == 1


def test_with_then_without_then_with(store: SQLiteStore) -> None:
    pool = KeyPool(store, size=2)
    app, _ = build(pool, limit=6)
    with TestClient(app) as client:  # lifespan starts the pool on the portal's loop
        assert [within(lambda: client.get("/").status_code) for _ in range(2)] == [200, 200]
    assert not pool.started  # lifespan shutdown closed it
    bare = TestClient(app)
    assert [within(lambda: bare.get("/").status_code) for _ in range(2)] == [200, 200]
    with TestClient(app) as client:
        codes = [within(lambda: client.get("/").status_code) for _ in range(3)]
    assert codes == [200, 200, 429]
    assert counted(store) == 6


# One app and pool for the tests below, each on its own event loop (function-scoped
# loops of anyio and pytest-asyncio, TestClient's portals).
@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[ASGIApp, KeyPool, SQLiteStore]]:
    store = SQLiteStore.temporary()
    pool = KeyPool(store, size=2)
    app, _ = build(pool, limit=1000)
    yield app, pool, store
    asyncio.run(pool.close())


async def asgi_get(app: ASGIApp, n: int) -> list[int]:
    transport = httpx.ASGITransport(app=app, client=("10.9.9.9", 1000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return [(await client.get("/")).status_code for _ in range(n)]


@pytest.mark.anyio
@pytest.mark.parametrize("n", [1, 2])
async def test_anyio_tests_in_a_row(shared: tuple[ASGIApp, KeyPool, SQLiteStore], n: int) -> None:
    app, _, _ = shared
    assert await asyncio.wait_for(asgi_get(app, 2), DEADLINE) == [200, 200]


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2])
async def test_pytest_asyncio_tests_in_a_row(
    shared: tuple[ASGIApp, KeyPool, SQLiteStore], n: int
) -> None:
    app, _, _ = shared
    assert await asyncio.wait_for(asgi_get(app, 2), DEADLINE) == [200, 200]


def test_testclient_in_a_row_after_the_async_tests(
    shared: tuple[ASGIApp, KeyPool, SQLiteStore],
) -> None:
    app, _, store = shared
    client = TestClient(app)
    assert within(lambda: client.get("/").status_code) == 200
    # Every request of this module's shared app so far, from the rows.
    assert counted(store) == 2 * 2 + 2 * 2 + 1


def test_a_loop_still_running_elsewhere_is_never_abandoned(store: SQLiteStore) -> None:
    pool = KeyPool(store, size=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(pool.start(), loop).result(DEADLINE)

        async def elsewhere() -> None:
            await pool.start()

        with pytest.raises(PoolClosedError, match="another event loop that is still running"):
            within(lambda: asyncio.run(elsewhere()))
        app, _ = build(pool)

        # The pool's own loop still serves (nothing was abandoned).
        async def serve() -> list[int]:
            return await asgi_get(app, 1)

        assert asyncio.run_coroutine_threadsafe(serve(), loop).result(DEADLINE) == [200]
        asyncio.run_coroutine_threadsafe(pool.close(), loop).result(DEADLINE)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE)
        loop.close()


def test_off_switch_passes_through_and_never_opens_the_store(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path)
    pool = KeyPool(store)

    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"hello": True})

    app = Starlette(routes=[Route("/", hello)])
    guarded = IdempotencyMiddleware(app, pool=pool, enabled=False)
    limited = RateLimitMiddleware(guarded, pool=pool, rules=Rule(Limit(1, 60.0)), enabled=False)
    with TestClient(limited) as client:
        codes = [within(lambda: client.get("/").status_code) for _ in range(3)]
    assert codes == [200, 200, 200]
    assert not store.path.exists()


def test_temporary_store_is_removed_with_the_object() -> None:
    store = SQLiteStore.temporary()
    directory = store.path.parent

    async def use(store: SQLiteStore) -> None:
        async with KeyPool(store) as pool:
            app, _ = build(pool)
            assert await asgi_get(app, 1) == [200]

    asyncio.run(use(store))
    assert directory.is_dir()
    del store
    gc.collect()
    assert not directory.exists()


def test_a_forked_child_moves_the_pool(store: SQLiteStore) -> None:
    """A pool started in a parent (its loop running there) serves a forked child's loop."""
    pool = KeyPool(store, size=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(pool.start(), loop).result(DEADLINE)
        app, _ = build(pool)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's result is its exit code
            code = 1
            try:
                code = 0 if asyncio.run(asyncio.wait_for(asgi_get(app, 1), 20)) == [200] else 2
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        deadline = time.monotonic() + DEADLINE
        while (done := os.waitpid(child, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                pytest.fail("the forked child hung")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(done[1]) == 0
        asyncio.run_coroutine_threadsafe(pool.close(), loop).result(DEADLINE)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE)
        loop.close()


@pytest.mark.postgres
def test_testclient_without_with_on_postgres(postgres_url: str) -> None:
    """A network store follows the pool to each new loop too (its connections reopened)."""
    schema = f"loops_{uuid.uuid4().hex[:12]}"
    pool = KeyPool(open_store(postgres_url, schema=schema), size=2)
    app, runs = build(pool, limit=3)
    client = TestClient(app)
    statuses = [within(lambda: client.get("/").status_code) for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    pool = KeyPool(open_store(postgres_url, schema=schema + "_i"), size=2)
    app, runs = build(pool, limit=100)
    client = TestClient(app)
    headers = {"Idempotency-Key": "order-1", "Authorization": "Bearer alice"}
    first = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    second = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    assert first.status_code == 200
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert len(runs) == 1


@pytest.mark.redis
def test_testclient_without_with_on_redis(redis_url: str) -> None:
    """The Redis store follows the pool to each new loop too (its clients reopened)."""
    prefix = f"loops-{uuid.uuid4().hex[:12]}"
    pool = KeyPool(open_store(redis_url, prefix=prefix), size=2)
    app, _ = build(pool, limit=3)
    client = TestClient(app)
    statuses = [within(lambda: client.get("/").status_code) for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    pool = KeyPool(open_store(redis_url, prefix=prefix + "-i"), size=2)
    app, runs = build(pool, limit=100)
    client = TestClient(app)
    headers = {"Idempotency-Key": "order-1", "Authorization": "Bearer alice"}
    first = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    second = within(lambda: client.post("/orders", content=b"tea", headers=headers))
    assert first.status_code == 200
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert len(runs) == 1
