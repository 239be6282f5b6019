"""Per-route limits and idempotency on Starlette routes (porch.integrations.starlette)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route

from porch import ConfigurationError, KeyPool, RateLimitMiddleware, Rule, SQLiteStore
from porch.integrations.starlette import RateLimitExceeded, idempotent, install, limit
from porch.ratelimit import CostRequest, settle
from support import asgi_client
from support import sqlite_counters as counters

pytestmark = pytest.mark.anyio

PEER = "10.3.3.3"


def client(app: Any, peer: str = PEER) -> httpx.AsyncClient:
    return asgi_client(app, peer)


def follow_app(pool: KeyPool, **starlette: Any) -> tuple[Starlette, list[str]]:
    calls: list[str] = []

    @limit("2/minute")
    async def follow(request: Request) -> Response:
        calls.append(request.path_params["id"])
        return PlainTextResponse("followed")

    async def other(request: Request) -> Response:
        return PlainTextResponse("free")

    app = Starlette(
        routes=[
            Route("/users/{id}/follow", follow, methods=["POST"]),
            Route("/users/{id}", other),
        ],
        **starlette,
    )
    assert install(app, pool) == 1
    return app, calls


async def test_a_route_template_is_limited_with_headers_and_the_middlewares_body(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, calls = follow_app(pool)
    async with client(app) as c:
        responses = [await c.post(f"/users/{i}/follow") for i in (1, 2, 3)]
        assert (await c.get("/users/1")).status_code == 200  # another route: not counted
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert calls == ["1", "2"]
    assert [r.headers["x-ratelimit-remaining"] for r in responses] == ["1", "0", "0"]
    assert responses[0].headers["ratelimit-policy"] == '"2-per-60s";q=2;w=60'
    refused = responses[2]
    assert refused.headers["retry-after"] == "60"
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["violated"] == [
        {"policy": "2-per-60s", "level": "client", "limit": 2, "window": 60.0, "reset_after": 60}
    ]
    assert counters(tmp_path) == {
        f"rl\x1froute:POST:/users/{{id}}/follow\x1f2-per-60s\x1f{PEER}": 2
    }


async def test_redirects_404_and_405_are_not_counted(pool: KeyPool, tmp_path: Path) -> None:
    app, calls = follow_app(pool)  # redirect_slashes is on by default
    async with client(app) as c:
        redirected = await c.post("/users/1/follow/", follow_redirects=False)
        assert redirected.status_code == 307
        assert redirected.headers["location"].endswith("/users/1/follow")
        assert (await c.get("/users/1/follow")).status_code == 405
        assert (await c.post("/nowhere")).status_code == 404
        assert counters(tmp_path) == {}
        # Following the redirect: one request reaches the route, one is counted.
        followed = await c.post("/users/1/follow/", follow_redirects=True)
    assert followed.status_code == 200
    assert followed.headers["x-ratelimit-remaining"] == "1"
    assert calls == ["1"]
    assert counters(tmp_path) == {
        f"rl\x1froute:POST:/users/{{id}}/follow\x1f2-per-60s\x1f{PEER}": 1
    }


async def test_route_limits_and_the_app_middleware_share_one_pool_not_counters(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, _ = follow_app(pool)
    app.add_middleware(RateLimitMiddleware, pool=pool, rules=Rule("100/minute"))
    async with client(app) as c:
        for i in range(3):
            await c.post(f"/users/{i}/follow")
    assert counters(tmp_path) == {
        f"rl\x1fdefault\x1f100-per-60s\x1f{PEER}": 3,
        f"rl\x1froute:POST:/users/{{id}}/follow\x1f2-per-60s\x1f{PEER}": 2,
    }


async def test_the_apps_handler_shapes_the_429(pool: KeyPool) -> None:
    async def teapot(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RateLimitExceeded)
        return JSONResponse(
            {"error": "slow down", "policies": [p.name for p in exc.refusal.violated]},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    app, _ = follow_app(pool, exception_handlers={RateLimitExceeded: teapot})
    async with client(app) as c:
        responses = [await c.post("/users/1/follow") for _ in range(3)]
    refused = responses[2]
    assert refused.status_code == 429
    assert refused.json() == {"error": "slow down", "policies": ["2-per-60s"]}
    assert refused.headers["retry-after"] == "60"
    assert refused.headers["x-ratelimit-remaining"] == "0"
    assert refused.headers["ratelimit"] == '"2-per-60s";r=0;t=60'


async def test_a_catch_all_http_handler_keeps_porchs_body_a_429_handler_does_not(
    pool: KeyPool,
) -> None:
    async def generic(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("generic", status_code=418)

    app, _ = follow_app(pool, exception_handlers={HTTPException: generic})
    async with client(app) as c:
        statuses = [(await c.post("/users/1/follow")) for _ in range(3)]
    assert statuses[2].status_code == 429
    assert statuses[2].headers["content-type"] == "application/problem+json"

    async def by_status(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return PlainTextResponse("by status", status_code=429, headers=exc.headers)

    app2, _ = follow_app(pool, exception_handlers={429: by_status})
    async with client(app2, peer="10.3.3.4") as c:
        refused = [(await c.post("/users/1/follow")) for _ in range(3)][2]
    assert (refused.status_code, refused.text) == (429, "by status")
    assert refused.headers["retry-after"] == "60"


async def test_idempotency_on_a_route_replays_and_runs_once(pool: KeyPool) -> None:
    orders: list[bytes] = []

    @idempotent()
    @limit("10/minute")
    async def create(request: Request) -> Response:
        orders.append(await request.body())
        return JSONResponse({"order": len(orders)}, status_code=201)

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    install(app, pool)
    async with client(app) as c:
        first = await c.post("/orders", content=b"tea", headers={"Idempotency-Key": "k1"})
        again = await c.post("/orders", content=b"tea", headers={"Idempotency-Key": "k1"})
        other = await c.post("/orders", content=b"cake", headers={"Idempotency-Key": "k1"})
        unkeyed = await c.post("/orders", content=b"tea")
    assert (first.status_code, again.status_code, other.status_code) == (201, 201, 422)
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert orders == [b"tea", b"tea"]  # the keyed one once, the unkeyed one
    assert unkeyed.status_code == 201
    # Replays are counted too: the limit sits outside idempotency.
    assert unkeyed.headers["x-ratelimit-remaining"] == "6"


async def test_required_key_and_a_mount_prefix(pool: KeyPool, tmp_path: Path) -> None:
    @idempotent(required=True)
    @limit("5/minute", key=lambda scope: dict(scope["headers"]).get(b"x-api-key", b"").decode())
    async def pay(request: Request) -> Response:
        return PlainTextResponse("paid")

    app = Starlette(routes=[Mount("/api", routes=[Route("/pay/{id}", pay, methods=["POST"])])])
    install(app, pool)
    async with client(app) as c:
        missing = await c.post("/api/pay/1", headers={"x-api-key": "alice"})
        paid = await c.post("/api/pay/1", headers={"x-api-key": "alice", "Idempotency-Key": "p1"})
    assert missing.status_code == 400
    assert paid.status_code == 200
    assert counters(tmp_path) == {"rl\x1froute:POST:/api/pay/{id}\x1f5-per-60s\x1falice": 2}


async def test_limits_of_one_route_are_all_or_nothing(pool: KeyPool, tmp_path: Path) -> None:
    @limit("3/minute")
    @limit("2/second", name="burst")
    @limit("1/hour; 5/day", name="slow")
    async def hello(request: Request) -> Response:
        return PlainTextResponse("hi")

    # "burst" and "slow" are named apart from the unnamed one: three rules (three layers).
    app = Starlette(routes=[Route("/hi", hello)])
    install(app, pool)
    async with client(app) as c:
        statuses = [(await c.get("/hi")).status_code for _ in range(3)]
    assert statuses == [200, 429, 429]
    rows = counters(tmp_path)
    # A refusal by the "slow" rule consumed nothing of it; the outer rules counted
    # each request they passed on (each rule is its own all-or-nothing check).
    assert rows[f"rl\x1fslow\x1f1-per-3600s\x1f{PEER}"] == 1
    assert rows[f"rl\x1fslow\x1f5-per-86400s\x1f{PEER}"] == 1


async def test_a_name_taken_on_the_pool_fails_at_install(pool: KeyPool) -> None:
    @limit("5/minute", name="auth")
    async def login(request: Request) -> Response:
        return PlainTextResponse("in")

    @limit("5/minute", name="auth")
    async def signup(request: Request) -> Response:
        return PlainTextResponse("up")

    app = Starlette(
        routes=[
            Route("/login", login, methods=["POST"]),
            Route("/signup", signup, methods=["POST"]),
        ]
    )
    with pytest.raises(ConfigurationError) as info:
        install(app, pool)
    assert str(info.value) == (
        "rule name 'auth' (the route limit on POST:/signup) is already used on this pool by"
        " the route limit on POST:/login; give one of them another name=, or shared=True on"
        " both to count them together"
    )


async def test_shared_route_limits_count_together(pool: KeyPool, tmp_path: Path) -> None:
    @limit("3/minute", name="auth", shared=True)
    async def login(request: Request) -> Response:
        return PlainTextResponse("in")

    @limit("3/minute", name="auth", shared=True)
    async def signup(request: Request) -> Response:
        return PlainTextResponse("up")

    app = Starlette(
        routes=[
            Route("/login", login, methods=["POST"]),
            Route("/signup", signup, methods=["POST"]),
        ]
    )
    install(app, pool)
    async with client(app) as c:
        statuses = [(await c.post(p)).status_code for p in ("/login", "/signup") * 2]
    assert statuses == [200, 200, 200, 429]
    assert counters(tmp_path) == {f"rl\x1fauth\x1f3-per-60s\x1f{PEER}": 3}


async def test_a_declared_route_never_installed_answers_503(pool: KeyPool) -> None:
    @limit("5/minute")
    async def hello(request: Request) -> Response:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/hi", hello)])
    async with client(app) as c:
        response = await c.get("/hi")
    assert response.status_code == 503
    assert response.json()["cause"] == "configuration"


async def test_install_opens_and_closes_the_pool_with_the_lifespan(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    # Its own pool: TestClient runs the app on an event loop of its own (in a thread here).
    pool = KeyPool(SQLiteStore(tmp_path / "lifespan"), size=2)
    app, _ = follow_app(pool)

    def serve() -> None:
        with TestClient(app) as c:
            assert pool.started
            assert c.post("/users/1/follow").status_code == 200
        assert not pool.started

    await anyio.to_thread.run_sync(serve)


async def test_routes_under_hosts_are_installed_and_counted_per_host(
    pool: KeyPool, tmp_path: Path
) -> None:
    from starlette.routing import Host, Router

    @limit("1/minute")
    async def items(request: Request) -> Response:
        return PlainTextResponse("items")

    def site() -> Router:
        return Router(routes=[Route("/items", items)])

    app = Starlette(routes=[Host("api.example.com", site()), Host("{tenant}.shop.test", site())])
    assert install(app, pool) == 2
    async with client(app) as c:
        api = [(await c.get("http://api.example.com/items")).status_code for _ in range(2)]
        shop = [(await c.get("http://a.shop.test/items")).status_code for _ in range(2)]
    assert api == [200, 429]
    assert shop == [200, 429]  # the same path on another host: a counter of its own
    # Named for the host too (the methods part of a name depends on Starlette's version).
    assert sorted(key.split(":", 2)[2] for key in counters(tmp_path)) == [
        "api.example.com/items\x1f1-per-60s\x1f" + PEER,
        "{tenant}.shop.test/items\x1f1-per-60s\x1f" + PEER,
    ]


async def test_a_mounted_sub_app_with_its_own_middlewares_is_installed(
    pool: KeyPool, tmp_path: Path
) -> None:
    from starlette.middleware import Middleware
    from starlette.middleware.gzip import GZipMiddleware

    from porch import Limit

    @limit("2/minute")
    async def orders(request: Request) -> Response:
        return PlainTextResponse("orders")

    async def products(request: Request) -> Response:
        return PlainTextResponse("products")

    sub = Starlette(
        routes=[Route("/orders", orders), Route("/products", products)],
        middleware=[
            Middleware(
                RateLimitMiddleware,
                pool=pool,
                rules=Rule(Limit(3, 60), path="/products", name="products"),
            )
        ],
    )
    # And an app behind a plain ASGI middleware: its routes are found through .app.
    wrapped = GZipMiddleware(Starlette(routes=[Route("/orders", orders)]))
    app = Starlette(routes=[Mount("/v1", app=sub), Mount("/v2", app=wrapped)])
    assert install(app, pool) == 2
    async with client(app) as c:
        v1 = [(await c.get("/v1/orders")).status_code for _ in range(3)]
        v2 = [(await c.get("/v2/orders")).status_code for _ in range(3)]
        products_ = [(await c.get("/v1/products")).status_code for _ in range(4)]
    assert v1 == [200, 200, 429]
    assert v2 == [200, 200, 429]
    assert products_ == [200, 200, 200, 429]  # the sub-app's middleware, at /products
    assert counters(tmp_path)["rl\x1fproducts\x1f3-per-60s\x1f" + PEER] == 3


async def test_a_declaration_porch_cannot_install_fails_install_and_startup(
    pool: KeyPool,
) -> None:
    from starlette.routing import BaseRoute, Match

    @limit("1/minute")
    async def hidden(request: Request) -> Response:
        return PlainTextResponse("hidden")

    class OwnRoute(BaseRoute):
        """A route class of the app's own: porch does not know what it calls."""

        endpoint = staticmethod(hidden)

        def matches(self, scope: Any) -> tuple[Match, dict[str, Any]]:
            return Match.NONE, {}

        def url_path_for(self, name: str, /, **params: Any) -> Any:
            raise NotImplementedError

        async def handle(self, scope: Any, receive: Any, send: Any) -> None:
            await hidden(scope)  # pragma: no cover

        def __repr__(self) -> str:
            return "OwnRoute()"

    message = (
        "porch cannot install the limits or idempotency declared on OwnRoute() (a"
        " test_a_declaration_porch_cannot_install_fails_install_and_startup.<locals>.OwnRoute):"
        " install() guards Route, WebSocketRoute and FastAPI's routes, inside Mount and Host;"
        " declare them on one of those, or use the app-level middlewares"
    )
    app = Starlette(routes=[Mount("/m", routes=[OwnRoute()])])
    with pytest.raises(ConfigurationError) as refused:
        install(app, pool)
    assert str(refused.value) == message
    # Added after install(): the app refuses to start, with the same message.
    late = Starlette()
    assert install(late, pool) == 0
    late.router.routes.append(OwnRoute())
    with pytest.raises(ConfigurationError) as at_startup:
        async with late.router.lifespan_context(late):
            pass  # pragma: no cover
    assert str(at_startup.value) == message


async def test_a_route_limit_declared_switched_off(pool: KeyPool) -> None:
    @limit("1/minute", enabled=False)
    async def hello(request: Request) -> Response:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/hi", hello)])
    assert install(app, pool) == 1
    async with client(app) as c:
        assert [(await c.get("/hi")).status_code for _ in range(3)] == [200] * 3


async def test_a_decorated_endpoint_reserves_its_pages_and_settles_what_it_used(
    pool: KeyPool, tmp_path: Path
) -> None:
    def pages(request: CostRequest) -> int:
        return int(request.scope["query_string"].decode().removeprefix("pages="))

    @limit("10/minute", cost=pages, settle=True)
    async def export(request: Request) -> Response:
        used = int(request.query_params["pages"]) // 2  # half of them were empty
        assert settle(request, used)
        return PlainTextResponse(f"exported {used}")

    app = Starlette(routes=[Route("/export", export)])
    install(app, pool)
    async with client(app) as c:
        first = await c.get("/export?pages=8")  # 8 reserved, 4 used
        second = await c.get("/export?pages=4")  # 4 + 4 <= 10; 2 used
        third = await c.get("/export?pages=5")  # 4 + 2 + 5 > 10
    assert [first.status_code, second.status_code, third.status_code] == [200, 200, 429]
    assert first.headers["x-ratelimit-remaining"] == "2"  # told at the reservation
    assert counters(tmp_path) == {f"rl\x1froute:GET:/export\x1f10-per-60s\x1f{PEER}": 6}
