"""One IdempotencyPolicy per rule: the middleware's rules, route declarations, the WSGI bridge."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyPolicy,
    IdempotencyRule,
    KeyPool,
    ManualClock,
    SQLiteStore,
)
from porch.integrations.starlette import idempotent, install
from porch.integrations.wsgi import WSGIMiddleware
from support import until

from .test_middleware import Handler, keyed, no_cookies

pytestmark = pytest.mark.anyio


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", cookies=no_cookies()
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl must be > 0 seconds, got 0"),
        ({"wait_timeout": -1}, "wait_timeout must be > 0 seconds, got -1"),
        ({"concurrent": "queue"}, "concurrent must be 'wait' or 'conflict', got 'queue'"),
        ({"max_body": -1}, "max_body must be >= 0 bytes, got -1"),
        ({"max_stored": -2}, "max_stored must be >= 0 bytes, got -2"),
        ({"statuses": [200, 101]}, "statuses must be final statuses 200-599, got 101"),
        ({"statuses": [True]}, "statuses must be integers, got True"),
        ({"fingerprint": "xml"}, "fingerprint must be 'bytes', 'json', a JSONFingerprint"),
        ({"digest_headers": "x-account"}, "digest_headers must be a sequence of header names"),
        ({"digest_headers": ["bad name"]}, "digest_headers entry 'bad name' is not a header"),
    ],
)
def test_policy_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyPolicy(**kwargs)


def test_policy_is_frozen_and_compares_by_value() -> None:
    policy = IdempotencyPolicy(ttl=300, statuses=range(200, 300), digest_headers=["X-Account"])
    assert policy == IdempotencyPolicy(
        ttl=300.0, statuses=set(range(200, 300)), digest_headers=["x-account"]
    )
    assert policy.digest_headers == (b"content-type", b"x-account")
    with pytest.raises(AttributeError):
        policy.ttl = 1  # type: ignore[misc]
    assert policy.replace(ttl=5).ttl == 5
    assert policy.replace(ttl=5).statuses == policy.statuses
    with pytest.raises(ConfigurationError, match="ttl must be > 0"):
        policy.replace(ttl=0)


def test_rules_resolve_against_the_middlewares_policy(tmp_path: Path) -> None:
    base = IdempotencyPolicy(ttl=60, concurrent="conflict")
    own = IdempotencyPolicy(ttl=5)
    rule = IdempotencyRule("/a", required=True, digest_headers=["X-A"])
    assert rule.resolve(base) == base.replace(required=True, digest_headers=[b"x-a"])
    assert IdempotencyRule("/b", policy=own).resolve(base) is own
    assert IdempotencyRule("/c", policy=own, required=True).resolve(base) == own.replace(
        required=True
    )
    with pytest.raises(ConfigurationError, match="policy must be an IdempotencyPolicy"):
        IdempotencyRule("/d", policy={"ttl": 5})  # type: ignore[arg-type]
    # The keywords from before policies still work, and change the given policy.
    pool = KeyPool(SQLiteStore(tmp_path))
    app = IdempotencyMiddleware(Handler(), pool=pool, policy=base, ttl=10, max_stored=7)
    assert app.policy == base.replace(ttl=10, max_stored=7)
    assert (app.ttl, app.max_stored, app.wait_timeout) == (10.0, 7, 30.0)


async def test_statuses_stored_per_rule(tmp_path: Path) -> None:
    handler = Handler()
    handler.status = 400
    rules = [
        IdempotencyRule("/only-2xx", policy=IdempotencyPolicy(statuses=range(200, 300))),
        IdempotencyRule("/also-500", policy=IdempotencyPolicy(statuses=[400, 500])),
        IdempotencyRule("/"),
    ]
    async with (
        KeyPool(SQLiteStore(tmp_path)) as pool,
        client(IdempotencyMiddleware(handler, pool=pool, rules=rules)) as c,
    ):
        for _ in range(2):
            await c.post("/only-2xx", content=b"b", headers=keyed("a"))
        assert handler.calls == 2  # a 400 is not stored there: it ran again
        await c.post("/", content=b"b", headers=keyed("b"))
        again = await c.post("/", content=b"b", headers=keyed("b"))
        assert handler.calls == 3  # the default stores a 400
        assert again.headers["idempotent-replayed"] == "true"
        handler.fail_first = 10  # every call answers 500 now
        first = await c.post("/also-500", content=b"b", headers=keyed("c"))
        second = await c.post("/also-500", content=b"b", headers=keyed("c"))
    assert first.status_code == second.status_code == 500
    assert second.headers["idempotent-replayed"] == "true"
    assert handler.calls == 4


async def test_ttl_per_rule(tmp_path: Path) -> None:
    clock = ManualClock()
    handler = Handler()
    rules = [IdempotencyRule("/export", policy=IdempotencyPolicy(ttl=300)), IdempotencyRule("/")]
    async with (
        KeyPool(SQLiteStore(tmp_path, clock=clock)) as pool,
        client(IdempotencyMiddleware(handler, pool=pool, rules=rules, ttl=3600)) as c,
    ):
        await c.post("/export", content=b"b", headers=keyed("e"))
        await c.post("/pay", content=b"b", headers=keyed("p"))
        clock.advance(300)
        export = await c.post("/export", content=b"b", headers=keyed("e"))
        pay = await c.post("/pay", content=b"b", headers=keyed("p"))
    assert "idempotent-replayed" not in export.headers  # 5 minutes: gone
    assert pay.headers["idempotent-replayed"] == "true"  # an hour: kept
    assert handler.calls == 3


async def test_conflict_answers_a_concurrent_duplicate_at_once(tmp_path: Path) -> None:
    handler = Handler()
    handler.gate = asyncio.Event()
    # wait_timeout is far past the test's own deadline: a 409 here was not a wait's end.
    policy = IdempotencyPolicy(concurrent="conflict", wait_timeout=3600)
    async with KeyPool(SQLiteStore(tmp_path)) as pool:
        app = IdempotencyMiddleware(handler, pool=pool, policy=policy)
        async with client(app) as c:
            owner = asyncio.create_task(c.post("/o", content=b"b", headers=keyed()))
            await until(lambda: handler.calls == 1, "the owner runs the handler")
            duplicate = await asyncio.wait_for(
                c.post("/o", content=b"b", headers=keyed()), timeout=30
            )
            assert duplicate.status_code == 409
            assert duplicate.headers["retry-after"] == "1"
            assert not owner.done()
            handler.gate.set()
            assert (await asyncio.wait_for(owner, 30)).status_code == 201
            late = await c.post("/o", content=b"b", headers=keyed())
    assert late.headers["idempotent-replayed"] == "true"  # once stored, replayed as ever
    assert handler.calls == 1


async def test_required_and_max_body_per_rule(tmp_path: Path) -> None:
    handler = Handler()
    rules = [
        IdempotencyRule("/pay", policy=IdempotencyPolicy(required=True, max_body=4)),
        IdempotencyRule("/"),
    ]
    async with (
        KeyPool(SQLiteStore(tmp_path)) as pool,
        client(IdempotencyMiddleware(handler, pool=pool, rules=rules)) as c,
    ):
        assert (await c.post("/pay", content=b"b")).status_code == 400
        big = await c.post("/pay", content=b"12345", headers=keyed())
        assert big.status_code == 413
        assert "at most 4 bytes" in big.json()["detail"]
        assert (await c.post("/other", content=b"12345")).status_code == 201
        assert (await c.post("/other", content=b"12345", headers=keyed())).status_code == 201
    assert handler.calls == 2


async def test_route_declarations_take_a_policy(tmp_path: Path) -> None:
    runs: list[str] = []

    @idempotent(policy=IdempotencyPolicy(statuses=[201], required=True))
    async def create(request: Request) -> PlainTextResponse:
        runs.append((await request.body()).decode())
        return PlainTextResponse(f"run {len(runs)}", status_code=201 if len(runs) > 1 else 202)

    app = Starlette(routes=[Route("/c", create, methods=["POST"])])
    async with KeyPool(SQLiteStore(tmp_path)) as pool:
        install(app, pool, manage_pool=False)
        async with client(app) as c:
            assert (await c.post("/c", content=b"x")).status_code == 400  # required
            first = await c.post("/c", content=b"x", headers=keyed())
            second = await c.post("/c", content=b"x", headers=keyed())
            third = await c.post("/c", content=b"x", headers=keyed())
    assert (first.status_code, second.status_code, third.status_code) == (202, 201, 201)
    assert third.headers["idempotent-replayed"] == "true"  # 202 not stored, 201 stored
    assert runs == ["x", "x"]


def test_old_route_keywords_change_the_policy() -> None:
    from porch.integrations._routes import RouteIdempotency

    declared = RouteIdempotency(
        policy=IdempotencyPolicy(ttl=60, concurrent="conflict"),
        required=True,
        max_stored=10,
        digest_headers=["X-Account"],
    )
    assert declared.policy == IdempotencyPolicy(
        ttl=60, concurrent="conflict", required=True, max_stored=10, digest_headers=["x-account"]
    )
    assert declared.required
    with pytest.raises(ConfigurationError, match="wait_timeout must be > 0"):
        RouteIdempotency(wait_timeout=0)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wsgi_served(tmp_path: Path) -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        bodies.append(environ["wsgi.input"].read(length))
        status = "202 Accepted" if len(bodies) == 1 else "201 Created"
        start_response(status, [("Content-Type", "text/plain")])
        return [b"run %d" % len(bodies)]

    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    policy = IdempotencyPolicy(statuses=[201], fingerprint="json", required=True)
    guarded = WSGIMiddleware(
        app,
        pool=pool,
        wrap=lambda inner: IdempotencyMiddleware(
            inner, pool=pool, rules=IdempotencyRule("/", methods=["POST"], policy=policy)
        ),
    )
    server: WSGIServer = make_server("127.0.0.1", 0, guarded, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        guarded.close()


def test_the_wsgi_bridge_takes_the_rules_policy(wsgi_served: tuple[str, list[bytes]]) -> None:
    base, bodies = wsgi_served
    key = {"Idempotency-Key": "w", "Content-Type": "application/json"}
    assert httpx.post(base + "/o", content=b"{}", timeout=30).status_code == 400  # required
    first = httpx.post(base + "/o", content=b'{"a": 1, "b": 2}', headers=key, timeout=30)
    second = httpx.post(base + "/o", content=b'{"b":2,"a":1}', headers=key, timeout=30)
    third = httpx.post(base + "/o", content=b'{ "b" : 2, "a" : 1.0 }', headers=key, timeout=30)
    other = httpx.post(base + "/o", content=b'{"a": 1, "b": 3}', headers=key, timeout=30)
    assert (first.status_code, second.status_code) == (202, 201)  # a 202 is not stored
    assert third.status_code == 201
    assert third.headers["idempotent-replayed"] == "true"
    assert third.content == second.content == b"run 2"
    assert other.status_code == 422
    assert len(bodies) == 2
