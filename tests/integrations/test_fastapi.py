"""Per-route limits and idempotency on FastAPI routes (porch.integrations.fastapi), in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

from porch import ConfigurationError, IdempotencyPolicy, KeyPool, Limit, Plans, SQLiteStore
from porch.integrations.fastapi import (
    Idempotency,
    RateLimit,
    RateLimitExceeded,
    idempotent,
    install,
    limit,
)
from porch.ratelimit import CostRequest, settle
from support import asgi_client
from support import sqlite_counters as counters

pytestmark = pytest.mark.anyio

PEER = "10.4.4.4"


def client(app: Any) -> httpx.AsyncClient:
    return asgi_client(app, PEER)


def by_api_key(scope: Any) -> str:
    value: bytes = dict(scope["headers"]).get(b"x-api-key", b"-")
    return "key:" + value.decode()


def make_app(pool: KeyPool) -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    follows: list[int] = []

    @app.post(
        "/users/{user_id}/follow",
        dependencies=[Depends(RateLimit("2/minute; 100/day", key=by_api_key))],
    )
    async def follow(user_id: int) -> dict[str, int]:
        follows.append(user_id)
        return {"followed": user_id}

    @app.post("/orders", status_code=201, dependencies=[Depends(Idempotency())])
    async def order(body: dict[str, Any]) -> dict[str, Any]:
        follows.append(-1)
        return {"order": len(follows), **body}

    @app.post("/refunds", dependencies=[Depends(Idempotency(required=True))])
    async def refund() -> dict[str, str]:
        return {"refunded": "yes"}

    @app.post("/payments", status_code=201)
    @idempotent(required=True)
    @limit("5/minute")
    async def pay(request: Request) -> dict[str, str]:
        return {"paid": "yes"}

    @app.get("/free")
    async def free() -> dict[str, str]:
        return {"free": "yes"}

    assert install(app, pool) == 4
    return app, follows


async def test_a_dependency_limits_its_route_per_key_with_headers(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, follows = make_app(pool)
    async with client(app) as c:
        alice = [await c.post(f"/users/{i}/follow", headers={"x-api-key": "a"}) for i in (1, 2, 3)]
        bob = await c.post("/users/1/follow", headers={"x-api-key": "b"})
        assert (await c.get("/free")).status_code == 200
        slash = await c.post("/users/1/follow/", headers={"x-api-key": "b"})
    assert [r.status_code for r in alice] == [200, 200, 429]
    assert bob.status_code == 200
    assert follows == [1, 2, 1]
    assert (
        alice[0].headers["ratelimit-policy"]
        == '"2-per-60s";q=2;w=60, "100-per-86400s";q=100;w=86400'
    )
    assert alice[2].headers["retry-after"] == "60"
    assert alice[2].headers["content-type"] == "application/problem+json"
    assert slash.status_code == 307  # FastAPI's redirect_slashes: not counted
    prefix = "rl\x1froute:POST:/users/{user_id}/follow\x1f"
    assert counters(tmp_path) == {
        prefix + "2-per-60s\x1fkey:a": 2,
        prefix + "100-per-86400s\x1fkey:a": 2,  # the refused third consumed neither
        prefix + "2-per-60s\x1fkey:b": 1,
        prefix + "100-per-86400s\x1fkey:b": 1,
    }


async def test_idempotency_dependency_replays(pool: KeyPool) -> None:
    app, follows = make_app(pool)
    async with client(app) as c:
        first = await c.post("/orders", json={"item": "tea"}, headers={"Idempotency-Key": "o1"})
        again = await c.post("/orders", json={"item": "tea"}, headers={"Idempotency-Key": "o1"})
        missing = await c.post("/payments")
        paid = await c.post("/payments", headers={"Idempotency-Key": "p1"})
        # porch answers first (400, its problem body), not FastAPI's 422.
        unkeyed_refund = await c.post("/refunds")
        refunded = await c.post("/refunds", headers={"Idempotency-Key": "r1"})
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert follows == [-1]
    assert missing.status_code == 400
    assert paid.status_code == 201
    assert paid.headers["x-ratelimit-limit"] == "5"
    assert unkeyed_refund.status_code == 400
    assert unkeyed_refund.headers["content-type"] == "application/problem+json"
    assert refunded.status_code == 200


async def test_the_openapi_schema_documents_429_503_and_the_key(pool: KeyPool) -> None:
    app, _ = make_app(pool)
    async with client(app) as c:
        schema = (await c.get("/openapi.json")).json()
    follow = schema["paths"]["/users/{user_id}/follow"]["post"]
    assert {"429", "503"} <= set(follow["responses"])
    assert "Retry-After" in follow["responses"]["429"]["headers"]
    assert "application/problem+json" in follow["responses"]["429"]["content"]
    orders = schema["paths"]["/orders"]["post"]
    [key] = [p for p in orders["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["in"] == "header"
    assert "409" in orders["responses"]
    assert "429" not in orders["responses"]  # no limit declared there
    payments = schema["paths"]["/payments"]["post"]
    [key] = [p for p in payments["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["required"] is True
    assert {"409", "429", "503"} <= set(payments["responses"])
    assert "429" not in schema["paths"]["/free"]["get"]["responses"]
    [key] = schema["paths"]["/refunds"]["post"]["parameters"]
    assert (key["name"], key["required"]) == ("Idempotency-Key", True)
    assert key["required"] is True
    assert [p["required"] for p in orders["parameters"]] == [False]


async def test_an_exception_handler_shapes_the_429(pool: KeyPool) -> None:
    app, _ = make_app(pool)

    @app.exception_handler(RateLimitExceeded)
    async def handler(request: Request, exc: RateLimitExceeded) -> JSONResponse:
        return JSONResponse(
            {"slow_down": exc.refusal.retry_after}, status_code=429, headers=exc.headers
        )

    async with client(app) as c:
        refused = [await c.post("/users/1/follow", headers={"x-api-key": "a"}) for _ in range(3)]
    assert refused[2].status_code == 429
    assert refused[2].json() == {"slow_down": 60}
    assert refused[2].headers["retry-after"] == "60"
    assert refused[2].headers["x-ratelimit-remaining"] == "0"


async def test_a_dependency_on_a_route_never_installed_answers_503(pool: KeyPool) -> None:
    app = FastAPI()

    @app.get("/late", dependencies=[Depends(RateLimit("1/minute"))])
    async def late() -> dict[str, str]:
        return {}

    async with client(app) as c:
        response = await c.get("/late")
    assert response.status_code == 503


async def test_install_headers_choose_what_routes_send_and_the_schema_lists(
    pool: KeyPool,
) -> None:
    app = FastAPI()

    @app.get("/items", dependencies=[Depends(RateLimit("1/minute"))])
    async def items() -> dict[str, str]:
        return {}

    assert install(app, pool, headers="ietf") == 1
    async with client(app) as c:
        allowed, refused = await c.get("/items"), await c.get("/items")
        schema = (await c.get("/openapi.json")).json()
    assert (allowed.status_code, refused.status_code) == (200, 429)
    assert allowed.headers["ratelimit"] == '"1-per-60s";r=0;t=60'
    assert "x-ratelimit-limit" not in allowed.headers
    assert refused.headers["retry-after"] == "60"
    assert "x-ratelimit-remaining" not in refused.headers
    documented = schema["paths"]["/items"]["get"]["responses"]["429"]["headers"]
    assert set(documented) == {"Retry-After", "RateLimit-Policy", "RateLimit"}


async def test_install_refuses_an_unknown_header_style(pool: KeyPool) -> None:
    with pytest.raises(ConfigurationError, match="headers must be one of"):
        install(FastAPI(), pool, headers="X-RateLimit")  # type: ignore[arg-type]


def orders_router() -> tuple[APIRouter, list[str]]:
    """A router as most FastAPI apps are built: a router-level limit and a route-level one."""
    calls: list[str] = []
    router = APIRouter(prefix="/orders", dependencies=[Depends(RateLimit("2/minute"))])

    @router.get("", dependencies=[Depends(RateLimit("2/minute"))])
    async def orders() -> dict[str, str]:
        calls.append("orders")
        return {}

    @router.get("/{order_id}")
    @limit("1/minute")
    async def one(order_id: int) -> dict[str, int]:  # takes no request
        calls.append(f"one {order_id}")
        return {"order": order_id}

    @router.post("/{order_id}/cancel", status_code=202)
    @idempotent()
    async def cancel(order_id: int) -> dict[str, int]:
        calls.append(f"cancel {order_id}")
        return {"cancelled": order_id}

    return router, calls


async def test_routes_of_included_routers_are_installed(pool: KeyPool, tmp_path: Path) -> None:
    app = FastAPI()
    router, calls = orders_router()
    outer = APIRouter(prefix="/v1")
    outer.include_router(router)
    app.include_router(outer, prefix="/api")
    assert install(app, pool) == 3
    async with client(app) as c:
        listing = [(await c.get("/api/v1/orders")).status_code for _ in range(3)]
        one = [(await c.get("/api/v1/orders/7")).status_code for _ in range(2)]
        key = {"Idempotency-Key": "c1"}
        cancels = [await c.post("/api/v1/orders/7/cancel", headers=key) for _ in range(2)]
    assert listing == [200, 200, 429]
    # The router's dependency applies to every route of it: "2/minute" and "1/minute".
    assert one == [200, 429]
    assert [r.status_code for r in cancels] == [202, 202]
    assert cancels[1].headers["idempotent-replayed"] == "true"
    assert calls == ["orders", "orders", "one 7", "cancel 7"]
    prefix = "rl\x1froute:GET:/api/v1/orders"
    # The same "2/minute" on the router and its route is one limit, counted once.
    assert counters(tmp_path) == {
        prefix + "\x1f2-per-60s\x1f" + PEER: 2,
        prefix + "/{order_id}\x1f2-per-60s\x1f" + PEER: 1,
        prefix + "/{order_id}\x1f1-per-60s\x1f" + PEER: 1,
        # A replay is a request too: the limits sit outside idempotency.
        "rl\x1froute:POST:/api/v1/orders/{order_id}/cancel\x1f2-per-60s\x1f" + PEER: 2,
    }


async def test_a_router_included_twice_counts_each_inclusion_apart(
    pool: KeyPool,
) -> None:
    app = FastAPI()
    router, _ = orders_router()
    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/v2", dependencies=[Depends(RateLimit("1/minute"))])
    assert install(app, pool) == 6
    async with client(app) as c:
        v1 = [(await c.get("/v1/orders")).status_code for _ in range(3)]
        v2 = [(await c.get("/v2/orders")).status_code for _ in range(2)]
        schema = (await c.get("/openapi.json")).json()
    assert v1 == [200, 200, 429]
    assert v2 == [200, 429]  # the include call's own limit, on that inclusion only
    assert "429" in schema["paths"]["/v2/orders"]["get"]["responses"]
    assert "429" in schema["paths"]["/v1/orders"]["get"]["responses"]


async def test_a_mounted_fastapi_app_is_installed(pool: KeyPool) -> None:
    app = FastAPI()
    sub = FastAPI()
    router, _ = orders_router()
    sub.include_router(router)
    app.mount("/shop", sub)
    assert install(app, pool) == 3
    async with client(app) as c:
        statuses = [(await c.get("/shop/orders")).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


async def test_routes_added_after_install_are_installed_at_startup(pool: KeyPool) -> None:
    app = FastAPI()
    assert install(app, pool) == 0
    router, _ = orders_router()
    app.include_router(router)
    async with app.router.lifespan_context(app), client(app) as c:
        statuses = [(await c.get("/orders")).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


async def test_a_router_route_never_installed_answers_503_not_unlimited(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    app = FastAPI()
    router, calls = orders_router()
    app.include_router(router)
    async with client(app) as c:
        statuses = [(await c.get("/orders/1")).status_code for _ in range(3)]
    assert statuses == [503, 503, 503]
    assert calls == []
    # Logged once, not once per request.
    assert len([r for r in caplog.records if "never installed" in r.getMessage()]) == 1


def switchable_app(pool: KeyPool, **install_options: Any) -> tuple[FastAPI, dict[str, Any]]:
    """Routes with each kind of declaration, for the off switches and overrides."""
    app = FastAPI()
    hourly = RateLimit("2/hour")
    keyed = Idempotency()
    orders: list[int] = []

    async def current_user(_: None = Depends(hourly)) -> str:
        return "alice"

    @app.get("/items", dependencies=[Depends(hourly)])
    async def items() -> dict[str, str]:
        return {}

    @app.get("/me")
    async def me(user: str = Depends(current_user)) -> dict[str, str]:
        return {"user": user}

    @app.post("/orders", status_code=201, dependencies=[Depends(keyed)])
    async def order() -> dict[str, int]:
        orders.append(1)
        return {"order": len(orders)}

    @app.get("/decorated")
    @limit("1/hour")
    async def decorated() -> dict[str, str]:
        return {}

    assert install(app, pool, **install_options) == 4
    return app, {"hourly": hourly, "keyed": keyed, "user": current_user, "orders": orders}


async def statuses(c: httpx.AsyncClient, path: str, n: int) -> list[int]:
    return [(await c.get(path)).status_code for _ in range(n)]


async def test_install_switched_off_runs_every_route_unlimited_and_opens_nothing(
    tmp_path: Path,
) -> None:
    unopened = KeyPool(SQLiteStore(tmp_path / "off"))
    app, _ = switchable_app(unopened, enabled=False)
    async with app.router.lifespan_context(app), client(app) as c:
        assert await statuses(c, "/items", 4) == [200] * 4
        assert await statuses(c, "/decorated", 3) == [200] * 3  # not "never installed"
        key = {"Idempotency-Key": "o1"}
        orders = [await c.post("/orders", headers=key) for _ in range(2)]
    assert [o.json() for o in orders] == [{"order": 1}, {"order": 2}]
    assert "idempotent-replayed" not in orders[1].headers
    assert not unopened.started
    assert not (tmp_path / "off").exists()


async def test_a_declaration_switched_off_and_on_again(pool: KeyPool, tmp_path: Path) -> None:
    app, parts = switchable_app(pool)
    hourly: RateLimit = parts["hourly"]
    async with client(app) as c:
        assert await statuses(c, "/items", 1) == [200]
        hourly.enabled = False
        assert await statuses(c, "/items", 4) == [200] * 4
        hourly.enabled = True
        assert await statuses(c, "/items", 2) == [200, 429]  # the same counter as before
    assert counters(tmp_path)["rl\x1froute:GET:/items\x1f2-per-3600s\x1f" + PEER] == 2


async def test_dependency_overrides_switch_porch_dependencies_off(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, parts = switchable_app(pool)
    app.dependency_overrides[parts["hourly"]] = lambda: None
    app.dependency_overrides[parts["keyed"]] = lambda: None
    async with client(app) as c:
        assert await statuses(c, "/items", 4) == [200] * 4
        assert await statuses(c, "/me", 4) == [200] * 4
        # A decorator is no dependency: overrides do not touch it.
        assert await statuses(c, "/decorated", 2) == [200, 429]
        key = {"Idempotency-Key": "o1"}
        orders = [(await c.post("/orders", headers=key)).json() for _ in range(2)]
        assert orders == [{"order": 1}, {"order": 2}]  # no replay: overridden
        app.dependency_overrides.clear()
        assert await statuses(c, "/items", 3) == [200, 200, 429]
        replayed = [await c.post("/orders", headers={"Idempotency-Key": "o2"}) for _ in range(2)]
    assert replayed[1].headers["idempotent-replayed"] == "true"
    assert counters(tmp_path)["rl\x1froute:GET:/items\x1f2-per-3600s\x1f" + PEER] == 2


async def test_overriding_the_dependency_that_leads_to_a_limit_switches_it_off(
    pool: KeyPool,
) -> None:
    app, parts = switchable_app(pool)
    app.dependency_overrides[parts["user"]] = lambda: "bob"
    async with client(app) as c:
        assert await statuses(c, "/me", 4) == [200] * 4
        assert (await c.get("/me")).json() == {"user": "bob"}
        # /items reaches the same limit directly: still limited.
        assert await statuses(c, "/items", 3) == [200, 200, 429]


async def test_a_porch_dependency_overridden_by_another_applies_the_other(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, parts = switchable_app(pool)
    app.dependency_overrides[parts["hourly"]] = RateLimit("4/hour")
    async with client(app) as c:
        assert await statuses(c, "/items", 5) == [200] * 4 + [429]
        headers = (await c.get("/items")).headers
    assert headers["x-ratelimit-limit"] == "4"
    # Counted in the route's namespace, under the replacement's own limit.
    assert counters(tmp_path) == {"rl\x1froute:GET:/items\x1f4-per-3600s\x1f" + PEER: 4}


async def test_replays_count_unless_the_declaration_says_not(pool: KeyPool) -> None:
    app = FastAPI()
    runs: list[str] = []

    @app.post("/counted", dependencies=[Depends(RateLimit("2/hour")), Depends(Idempotency())])
    async def counted() -> dict[str, int]:
        runs.append("counted")
        return {"n": len(runs)}

    @app.post(
        "/free",
        dependencies=[
            Depends(RateLimit("2/hour")),
            Depends(Idempotency(count_replays=False)),
        ],
    )
    async def free() -> dict[str, int]:
        runs.append("free")
        return {"n": len(runs)}

    install(app, pool)
    key = {"Idempotency-Key": "k1"}
    async with client(app) as c:
        counted_ = [(await c.post("/counted", headers=key)).status_code for _ in range(3)]
        free_ = [await c.post("/free", headers={"Idempotency-Key": "k2"}) for _ in range(4)]
        fresh = [(await c.post("/free", headers={"Idempotency-Key": f"n{i}"})) for i in range(2)]
    assert counted_ == [200, 200, 429]  # the replay took the second unit
    assert [r.status_code for r in free_] == [200] * 4
    assert all(r.headers["idempotent-replayed"] == "true" for r in free_[1:])
    assert "x-ratelimit-limit" not in free_[1].headers  # answered before the limits
    assert [r.status_code for r in fresh] == [200, 429]  # 2/hour: only two ran
    assert runs == ["counted", "free", "free"]


async def test_a_route_limit_exempts_by_predicate(pool: KeyPool) -> None:
    app = FastAPI()

    def staff(scope: Any) -> bool:
        return dict(scope["headers"]).get(b"x-role") == b"staff"

    @app.get("/reports", dependencies=[Depends(RateLimit("1/hour", exempt=staff))])
    async def reports() -> dict[str, str]:
        return {}

    install(app, pool)
    async with client(app) as c:
        staffed = [(await c.get("/reports", headers={"x-role": "staff"})).status_code]
        staffed += [(await c.get("/reports", headers={"x-role": "staff"})).status_code]
        others = await statuses(c, "/reports", 2)
    assert staffed == [200, 200]
    assert others == [200, 429]


async def test_a_dependency_takes_a_policy(pool: KeyPool) -> None:
    app = FastAPI()
    runs: list[dict[str, Any]] = []
    policy = IdempotencyPolicy(required=True, fingerprint="json", statuses=[201])

    @app.post("/charges", status_code=201, dependencies=[Depends(Idempotency(policy=policy))])
    async def charge(body: dict[str, Any]) -> dict[str, Any]:
        runs.append(body)
        return {"charge": len(runs)}

    install(app, pool)
    async with client(app) as c:
        missing = await c.post("/charges", json={"a": 1})
        first = await c.post("/charges", content=b'{"a":1,"b":2}', headers=_json("c1"))
        again = await c.post("/charges", content=b'{ "b": 2, "a": 1 }', headers=_json("c1"))
        schema = (await c.get("/openapi.json")).json()
    assert missing.status_code == 400  # required, as the policy says
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == [{"a": 1, "b": 2}]
    [key] = schema["paths"]["/charges"]["post"]["parameters"]
    assert (key["name"], key["required"]) == ("Idempotency-Key", True)


def _json(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key, "Content-Type": "application/json"}


async def test_a_route_limit_takes_an_async_key_function(pool: KeyPool) -> None:
    app = FastAPI()

    async def account(scope: Any) -> str:
        api_key: bytes = dict(scope["headers"]).get(b"x-api-key", b"-")
        return "acct:" + api_key.decode()

    @app.get("/reports", dependencies=[Depends(RateLimit("1/hour", key=account))])
    async def reports() -> dict[str, str]:
        return {}

    install(app, pool)
    async with client(app) as c:
        a = [(await c.get("/reports", headers={"x-api-key": "a"})).status_code for _ in range(2)]
        b = (await c.get("/reports", headers={"x-api-key": "b"})).status_code
    assert a == [200, 429]
    assert b == 200


async def test_a_dependency_reserves_tokens_and_the_endpoint_settles_them(
    pool: KeyPool, tmp_path: Path
) -> None:
    # An LLM-style budget: the request's max_tokens reserved, what it used settled.
    app = FastAPI()

    async def max_tokens(request: CostRequest) -> int:
        return int((await request.json())["max_tokens"])

    budget = RateLimit("100/minute", name="tokens", key=by_api_key, cost=max_tokens, settle=True)

    @app.post("/completions", dependencies=[Depends(budget)])
    async def complete(request: Request, body: dict[str, Any]) -> dict[str, int]:
        used = min(body["max_tokens"], len(body["prompt"].split()))
        settle(request, used)
        return {"tokens": used}

    install(app, pool)
    key = {"x-api-key": "a"}
    async with client(app) as c:
        first = await c.post(
            "/completions", json={"prompt": "a b c", "max_tokens": 60}, headers=key
        )
        second = await c.post("/completions", json={"prompt": "d", "max_tokens": 90}, headers=key)
        third = await c.post("/completions", json={"prompt": "e", "max_tokens": 97}, headers=key)
    assert (first.status_code, first.json()) == (200, {"tokens": 3})
    assert first.headers["ratelimit"] == '"100-per-60s";r=40;t=60'  # told at the reservation
    assert (second.status_code, second.json()) == (200, {"tokens": 1})  # 3 + 90 <= 100
    assert third.status_code == 429  # 3 + 1 + 97 > 100
    assert counters(tmp_path) == {"rl\x1ftokens\x1f100-per-60s\x1fkey:a": 4}


async def test_a_dependency_counts_levels_and_plans(pool: KeyPool, tmp_path: Path) -> None:
    app = FastAPI()

    def plan_of(scope: Any) -> str | None:
        return "pro" if by_api_key(scope) == "key:p" else None

    limit = RateLimit(
        ["1/minute", Limit(3, 60, name="everyone", level="global")],
        name="api",
        key=by_api_key,
        plans=Plans(
            {"pro": ["2/minute", Limit(3, 60, name="everyone", level="global")]}, plan=plan_of
        ),
    )

    @app.get("/things", dependencies=[Depends(limit)])
    async def things() -> dict[str, str]:
        return {}

    install(app, pool)
    async with client(app) as c:
        pro = [(await c.get("/things", headers={"x-api-key": "p"})).status_code for _ in range(3)]
        free = await c.get("/things", headers={"x-api-key": "f"})
        over = await c.get("/things", headers={"x-api-key": "g"})
    assert pro == [200, 200, 429]
    assert free.status_code == 200  # the third of everyone's three
    assert (over.status_code, over.json()["level"]) == (429, "global")
    assert counters(tmp_path) == {
        "rl\x1fapi\x1fper-60s\x1fkey:p": 2,
        "rl\x1fapi\x1fper-60s\x1fkey:f": 1,
        "rl\x1fapi\x1feveryone\x1f": 3,
    }


# A key that is a dependency: the app's own auth resolves the user once per request, and the
# limit counts under what that resolved.

TOKENS = {"t-alice": "alice", "t-bob": "bob"}


def keyed_by_user_app(pool: KeyPool) -> tuple[FastAPI, dict[str, Any]]:
    """Limits keyed by ``Depends(user_key)`` on a route, on an APIRouter (included with a
    prefix) and on one of its routes; every resolution of the user recorded."""
    app = FastAPI()
    resolved: list[str | None] = []

    async def current_user(authorization: str | None = Header(None)) -> str | None:
        resolved.append(authorization)
        if authorization == "t-expired":
            raise HTTPException(401, "expired")
        return TOKENS.get(authorization or "")

    async def user_key(user: str | None = Depends(current_user)) -> str | None:
        return f"user:{user}" if user else None  # None: anonymous, counted by address

    per_user = RateLimit("2/minute", key=Depends(user_key))

    @app.get("/me", dependencies=[Depends(per_user)])
    async def me(user: str | None = Depends(current_user)) -> dict[str, str | None]:
        return {"user": user}

    router = APIRouter(
        prefix="/reports", dependencies=[Depends(RateLimit("3/minute", key=Depends(user_key)))]
    )

    @router.get("")
    async def reports(user: str | None = Depends(current_user)) -> dict[str, str | None]:
        return {"user": user}

    @router.post("/exports", dependencies=[Depends(RateLimit("1/minute", key=Depends(user_key)))])
    async def export() -> dict[str, str]:
        return {}

    app.include_router(router, prefix="/v1")
    assert install(app, pool) == 3
    return app, {"resolved": resolved, "per_user": per_user, "user": current_user}


async def test_a_limit_keyed_by_a_dependency_counts_what_the_apps_auth_resolved(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, parts = keyed_by_user_app(pool)
    alice, bob = {"authorization": "t-alice"}, {"authorization": "t-bob"}
    async with client(app) as c:
        mine = [await c.get("/me", headers=alice) for _ in range(3)]
        others = [(await c.get("/me", headers=bob)).status_code for _ in range(2)]
        anonymous = await statuses(c, "/me", 3)
    assert [r.status_code for r in mine] == [200, 200, 429]
    assert mine[0].json() == {"user": "alice"}
    assert others == [200, 200]
    assert anonymous == [200, 200, 429]
    # The user was resolved once per request: FastAPI's cache serves the limit's key and
    # the endpoint alike (and the refused request never reached the endpoint).
    assert len(parts["resolved"]) == 8
    prefix = "rl\x1froute:GET:/me\x1f2-per-60s\x1f"
    assert counters(tmp_path) == {
        prefix + "user:alice": 2,
        prefix + "user:bob": 2,
        prefix + PEER: 2,
    }


async def test_a_limit_keyed_by_a_dependency_answers_as_every_route_limit(
    pool: KeyPool,
) -> None:
    app, _ = keyed_by_user_app(pool)

    def by_user(scope: Any) -> str:  # the same key, read from the scope instead
        return "user:" + TOKENS[dict(scope["headers"])[b"authorization"].decode()]

    @app.get("/scoped", dependencies=[Depends(RateLimit("2/minute", key=by_user))])
    async def scoped() -> dict[str, str]:
        return {}

    install(app, pool)
    alice = {"authorization": "t-alice"}
    async with client(app) as c:
        deferred = [await c.get("/me", headers=alice) for _ in range(3)]
        scoped_ = [await c.get("/scoped", headers=alice) for _ in range(3)]
    for mine, theirs in zip(deferred, scoped_, strict=True):
        assert mine.status_code == theirs.status_code
        for header in ("ratelimit-policy", "ratelimit", "x-ratelimit-limit", "retry-after"):
            assert mine.headers.get(header) == theirs.headers.get(header), header
    assert deferred[2].headers["content-type"] == "application/problem+json"
    assert deferred[2].json() == scoped_[2].json()
    assert deferred[2].json()["violated"][0]["policy"] == "2-per-60s"


async def test_limits_keyed_by_a_dependency_on_a_router_and_its_route_both_count(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, parts = keyed_by_user_app(pool)
    alice = {"authorization": "t-alice"}
    async with client(app) as c:
        listed = [(await c.get("/v1/reports", headers=alice)).status_code for _ in range(2)]
        exports = [await c.post("/v1/reports/exports", headers=alice) for _ in range(2)]
        bob = (await c.post("/v1/reports/exports", headers={"authorization": "t-bob"})).status_code
    assert listed == [200, 200]
    assert [r.status_code for r in exports] == [200, 429]
    assert bob == 200
    # The router's limit (3/minute) and the route's (1/minute): both headers on a response.
    assert exports[0].headers["ratelimit-policy"].count("per-60s") == 2
    rows = counters(tmp_path)
    assert rows["rl\x1froute:GET:/v1/reports\x1f3-per-60s\x1fuser:alice"] == 2
    route = "rl\x1froute:POST:/v1/reports/exports"
    exported = {k: v for k, v in rows.items() if k.startswith(route) and k.endswith("alice")}
    # The third of the router's three, then the route refused: all-or-nothing per rule.
    assert sorted(exported.values()) == [1, 2], exported
    assert len(parts["resolved"]) == 5


async def test_a_key_dependency_that_refuses_refuses_before_anything_is_counted(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, _ = keyed_by_user_app(pool)
    async with client(app) as c:
        expired = await c.get("/me", headers={"authorization": "t-expired"})
    assert (expired.status_code, expired.json()) == (401, {"detail": "expired"})
    assert counters(tmp_path) == {}


async def test_a_key_dependency_returning_no_str_answers_503_and_logs(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    app = FastAPI()

    async def user_id() -> int:
        return 7  # a str is the key: f"user:{id}"

    @app.get("/ids", dependencies=[Depends(RateLimit("5/minute", key=Depends(user_id)))])
    async def ids() -> dict[str, str]:
        return {}

    install(app, pool)
    async with client(app) as c:
        answered = [(await c.get("/ids")).status_code for _ in range(2)]
    assert answered == [503, 503]
    [line] = [r.getMessage() for r in caplog.records if "not a str" in r.getMessage()]
    assert "returned int" in line


async def test_an_exception_handler_shapes_the_429_of_a_limit_keyed_by_a_dependency(
    pool: KeyPool,
) -> None:
    app, _ = keyed_by_user_app(pool)

    @app.exception_handler(RateLimitExceeded)
    async def handler(request: Request, exc: RateLimitExceeded) -> JSONResponse:
        return JSONResponse({"wait": exc.refusal.retry_after}, status_code=429, headers=exc.headers)

    async with client(app) as c:
        answers = [await c.get("/me", headers={"authorization": "t-bob"}) for _ in range(3)]
    assert (answers[2].status_code, answers[2].json()) == (429, {"wait": 60})
    assert answers[2].headers["x-ratelimit-remaining"] == "0"


async def test_limits_keyed_by_a_dependency_switch_off_and_follow_overrides(
    pool: KeyPool, tmp_path: Path
) -> None:
    app, parts = keyed_by_user_app(pool)
    per_user: RateLimit = parts["per_user"]
    alice = {"authorization": "t-alice"}
    async with client(app) as c:
        per_user.enabled = False
        assert [(await c.get("/me", headers=alice)).status_code for _ in range(3)] == [200] * 3
        per_user.enabled = True
        app.dependency_overrides[per_user] = lambda: None
        assert [(await c.get("/me", headers=alice)).status_code for _ in range(3)] == [200] * 3
        # Overridden by another keyed limit: that one counts, under the same key.
        app.dependency_overrides[per_user] = RateLimit("1/minute", key=Depends(lambda: "fixed"))
        assert [(await c.get("/me", headers=alice)).status_code for _ in range(2)] == [200, 429]
        # The user overridden (a test's fake user): the limit counts under that user.
        app.dependency_overrides.clear()
        app.dependency_overrides[parts["user"]] = lambda: "carol"
        assert [(await c.get("/me")).status_code for _ in range(3)] == [200, 200, 429]
    rows = counters(tmp_path)
    assert rows["rl\x1froute:GET:/me\x1f2-per-60s\x1fuser:carol"] == 2
    assert rows["rl\x1froute:GET:/me#override1\x1f1-per-60s\x1ffixed"] == 1
    assert "rl\x1froute:GET:/me\x1f2-per-60s\x1fuser:alice" not in rows


async def test_install_switched_off_skips_limits_keyed_by_a_dependency(tmp_path: Path) -> None:
    unopened = KeyPool(SQLiteStore(tmp_path / "off"))
    app = FastAPI()

    async def user_key() -> str:
        return "user:alice"

    @app.get("/me", dependencies=[Depends(RateLimit("1/hour", key=Depends(user_key)))])
    async def me() -> dict[str, str]:
        return {}

    assert install(app, unopened, enabled=False) == 1
    async with app.router.lifespan_context(app), client(app) as c:
        assert await statuses(c, "/me", 3) == [200] * 3
    assert not unopened.started


async def test_a_limit_keyed_by_a_dependency_never_installed_answers_503(pool: KeyPool) -> None:
    app = FastAPI()

    async def user_key() -> str:
        return "user:alice"

    @app.get("/late", dependencies=[Depends(RateLimit("1/hour", key=Depends(user_key)))])
    async def late() -> dict[str, str]:
        return {}

    async with client(app) as c:
        assert await statuses(c, "/late", 2) == [503, 503]


async def test_a_limit_keyed_by_a_dependency_reserves_and_the_endpoint_settles(
    pool: KeyPool, tmp_path: Path
) -> None:
    app = FastAPI()

    async def account(x_api_key: str = Header("-")) -> str:
        return "acct:" + x_api_key

    async def max_tokens(request: CostRequest) -> int:
        return int((await request.json())["max_tokens"])

    budget = RateLimit(
        "100/minute", name="tokens", key=Depends(account), cost=max_tokens, settle=True
    )

    @app.post("/completions", dependencies=[Depends(budget)])
    async def complete(request: Request, body: dict[str, Any]) -> dict[str, int]:
        used = min(body["max_tokens"], len(body["prompt"].split()))
        settle(request, used)
        return {"tokens": used}

    install(app, pool)
    key = {"x-api-key": "a"}
    async with client(app) as c:
        first = await c.post(
            "/completions", json={"prompt": "a b c", "max_tokens": 60}, headers=key
        )
        second = await c.post("/completions", json={"prompt": "d", "max_tokens": 90}, headers=key)
        third = await c.post("/completions", json={"prompt": "e", "max_tokens": 97}, headers=key)
    assert (first.status_code, first.json()) == (200, {"tokens": 3})
    assert first.headers["ratelimit"] == '"100-per-60s";r=40;t=60'  # told at the reservation
    assert (second.status_code, second.json()) == (200, {"tokens": 1})  # 3 + 90 <= 100
    assert third.status_code == 429  # 3 + 1 + 97 > 100
    assert counters(tmp_path) == {"rl\x1ftokens\x1f100-per-60s\x1facct:a": 4}


async def test_a_replay_never_counts_against_a_limit_keyed_by_a_dependency(
    pool: KeyPool,
) -> None:
    app = FastAPI()
    runs: list[int] = []

    async def user_key(authorization: str = Header("-")) -> str:
        return "user:" + authorization

    @app.post(
        "/orders",
        status_code=201,
        dependencies=[
            Depends(RateLimit("2/hour", key=Depends(user_key))),
            Depends(Idempotency()),
        ],
    )
    async def order() -> dict[str, int]:
        runs.append(1)
        return {"order": len(runs)}

    install(app, pool)
    async with client(app) as c:
        same = [await c.post("/orders", headers={"Idempotency-Key": "o1"}) for _ in range(3)]
        fresh = [(await c.post("/orders", headers={"Idempotency-Key": f"n{i}"})) for i in range(2)]
    assert [r.status_code for r in same] == [201] * 3
    assert all(r.headers["idempotent-replayed"] == "true" for r in same[1:])
    # Counted inside the route, behind idempotency: replays took nothing.
    assert [r.status_code for r in fresh] == [201, 429]
    assert runs == [1, 1]
    # A refused request's key is free again: its retry runs.
    assert "idempotent-replayed" not in fresh[1].headers


async def test_a_limit_keyed_by_a_dependency_on_a_websocket_route_fails_at_install(
    pool: KeyPool,
) -> None:
    app = FastAPI()

    async def user_key() -> str:
        return "user:alice"

    @app.websocket("/feed", dependencies=[Depends(RateLimit("1/hour", key=Depends(user_key)))])
    async def feed(websocket: Any) -> None:
        pass  # pragma: no cover - never installed

    with pytest.raises(ConfigurationError, match="WebSocket route"):
        install(app, pool)


async def test_a_plan_reads_what_the_key_dependency_resolved(pool: KeyPool, tmp_path: Path) -> None:
    # The plan is chosen after the key dependency ran: it can read what the dependency
    # left on request.state (the user's plan, from the same lookup).
    app = FastAPI()
    accounts = {"k-pro": ("acme", "pro"), "k-free": ("zeta", None)}

    async def account_key(request: Request, x_api_key: str = Header("-")) -> str | None:
        found = accounts.get(x_api_key)
        if found is None:
            return None
        name, plan = found
        if plan is not None:
            request.state.plan = plan
        return "acct:" + name

    async def plan_of(scope: Any) -> str | None:
        state: Any = scope.get("state", {})
        plan: str | None = state.get("plan")
        return plan

    limit = RateLimit(
        "1/minute",
        name="api",
        key=Depends(account_key),
        plans=Plans({"pro": "3/minute"}, plan=plan_of),
    )

    @app.get("/things", dependencies=[Depends(limit)])
    async def things() -> dict[str, str]:
        return {}

    install(app, pool)
    async with client(app) as c:
        pro = [
            (await c.get("/things", headers={"x-api-key": "k-pro"})).status_code for _ in range(4)
        ]
        free = [
            (await c.get("/things", headers={"x-api-key": "k-free"})).status_code for _ in range(2)
        ]
    assert pro == [200, 200, 200, 429]
    assert free == [200, 429]
    assert counters(tmp_path) == {
        "rl\x1fapi\x1fper-60s\x1facct:acme": 3,  # per window, whatever the plan
        "rl\x1fapi\x1fper-60s\x1facct:zeta": 1,
    }
