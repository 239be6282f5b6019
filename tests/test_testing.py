"""porch's pytest plugin (porch.testing), used as an app's tests use it: its fixtures are
loaded by pytest from porch's entry point, with no import."""

from __future__ import annotations

import contextlib
import textwrap
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from porch import ConfigurationError, KeyPool, Limit, RateLimitMiddleware, Rule
from porch.testing import Porch, assert_limited, assert_not_limited

pytest_plugins = ["pytester"]

# pytester drops from sys.modules, as a test ends, every module imported during it; asyncpg's
# compiled modules, imported again by a later test, crashed the interpreter (a segfault in
# the next PostgreSQL connect). Imported with this module, the drivers are kept.
with contextlib.suppress(ImportError):
    import asyncpg  # noqa: F401
    import redis.asyncio  # noqa: F401


def create_app(pool: KeyPool) -> Starlette:
    """An app factory that takes its pool, as an app's tests want it."""

    async def hello(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, pool=pool, rules=Rule(Limit(5, 60, name="five")))
    return app


def test_the_fixtures_limit_advance_and_reset(porch: Porch, porch_pool: KeyPool) -> None:
    with TestClient(create_app(porch_pool), client=("10.0.0.7", 1000)) as client:
        for _ in range(5):
            assert_not_limited(client.get("/"))
        porch.assert_limited(client.get("/"))
        assert porch.counts("10.0.0.7") == {"default/five": 5}
        porch.advance(60)  # the window has passed, on the store's clock and the limiter's
        porch.assert_not_limited(client.get("/"))
        for _ in range(4):
            client.get("/")
        porch.assert_limited(client.get("/"))  # and remembered by the limiter
        assert porch.reset("10.0.0.7") == 1
        porch.assert_not_limited(client.get("/"))
        assert porch.reset() == 1  # every client
        assert porch.counts("10.0.0.7") == {}


async def test_the_fixtures_in_an_async_test(porch: Porch, porch_pool: KeyPool) -> None:
    transport = httpx.ASGITransport(app=create_app(porch_pool), client=("10.0.0.8", 1000))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        responses = [await client.get("/") for _ in range(6)]
    for response in responses[:5]:
        assert_not_limited(response)
    assert_limited(responses[5])
    assert porch.counts("10.0.0.8") == {"default/five": 5}  # from a running loop too


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


pytestmark = pytest.mark.anyio


def test_the_assertions_fail_when_they_should() -> None:
    ok = httpx.Response(200)
    refused = httpx.Response(429, headers={"Retry-After": "3"})
    with pytest.raises(AssertionError, match="expected porch's 429, got 200"):
        assert_limited(ok)
    with pytest.raises(AssertionError, match="a 429 without a valid Retry-After"):
        assert_limited(httpx.Response(429))
    with pytest.raises(AssertionError, match=r"refused by a rate limit \(Retry-After: 3\)"):
        assert_not_limited(refused)


def run_plugin_tests(pytester: pytest.Pytester, url: str) -> None:
    """The plugin's fixtures in a project of their own, against the server at ``url``."""
    pytester.makepyfile(
        textwrap.dedent(
            """
            import asyncio

            from porch import Limit, RateLimitMiddleware, Rule

            async def ok(scope, receive, send):
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b""})

            async def hit(app):
                sent = []

                async def send(message):
                    sent.append(message)

                async def receive():
                    return {"type": "http.request"}

                scope = {"type": "http", "method": "GET", "path": "/", "headers": [],
                         "client": ("10.9.9.9", 1)}
                await app(scope, receive, send)
                return sent[0]["status"]

            def test_one(porch, porch_pool):
                app = RateLimitMiddleware(ok, pool=porch_pool, rules=Rule(Limit(1, 60)))
                assert asyncio.run(hit(app)) == 200
                assert asyncio.run(hit(app)) == 429
                assert porch.reset("10.9.9.9") == 1

            def test_the_window_moves_with_the_test_clock(porch, porch_pool):
                assert porch.honours_clock  # the server's store decides on the test's clock
                app = RateLimitMiddleware(ok, pool=porch_pool, rules=Rule(Limit(2, 60)))
                assert [asyncio.run(hit(app)) for _ in range(3)] == [200, 200, 429]
                porch.advance(59)  # the refusal stands until the window ends
                assert asyncio.run(hit(app)) == 429
                porch.advance(1)
                assert [asyncio.run(hit(app)) for _ in range(3)] == [200, 200, 429]
                assert porch.counts("10.9.9.9") == {"default/2-per-60s": 2}

            def test_two_starts_empty(porch):
                assert porch.counts("10.9.9.9") == {}
            """
        )
    )
    result = pytester.runpytest_inprocess(
        "--porch-store",
        url,
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
    )
    result.assert_outcomes(passed=3)


@pytest.mark.postgres
def test_each_test_gets_a_schema_of_its_own_on_postgres(
    pytester: pytest.Pytester, postgres_url: str
) -> None:
    run_plugin_tests(pytester, postgres_url)


@pytest.mark.redis
def test_each_test_gets_a_prefix_of_its_own_on_redis(
    pytester: pytest.Pytester, redis_url: str
) -> None:
    run_plugin_tests(pytester, redis_url)


def test_a_store_on_its_servers_clock_refuses_advance(porch: Porch) -> None:
    class ServerClock:
        capabilities = type("Capabilities", (), {"clock": None, "admin": None})()

    elsewhere = Porch(porch.clock, ServerClock(), porch.pool)  # type: ignore[arg-type]
    assert not elsewhere.honours_clock
    with pytest.raises(ConfigurationError, match="decides on its server's clock"):
        elsewhere.advance(1)
