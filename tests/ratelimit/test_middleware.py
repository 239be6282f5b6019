from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from porch import (
    ClientIdentity,
    ConfigurationError,
    KeyPool,
    Limit,
    ManualClock,
    RateLimitMiddleware,
    Refusal,
    Rule,
    SQLiteStore,
    StoreError,
)
from porch._responses import BytesResponse
from porch._types import ASGIApp, Message, Receive, Scope, Send
from porch.store.base import Capabilities, Claims, Hit, StoreOp, StoreStatistics
from support import NoClaims, until
from support import asgi_client as client

pytestmark = pytest.mark.anyio

WALL = 1_700_000_000.0


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_headers_count_down_then_429_with_problem_body(pool: KeyPool) -> None:
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(3, 60, name="api")))
    async with client(app) as c:
        responses = [await c.get("/x") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    for i, r in enumerate(responses[:3]):
        assert r.headers["x-ratelimit-limit"] == "3"
        assert r.headers["x-ratelimit-remaining"] == str(2 - i)
        assert r.headers["x-ratelimit-reset"] == str(int(WALL + 60))
        assert r.headers["ratelimit-policy"] == '"api";q=3;w=60'
        assert r.headers["ratelimit"] == f'"api";r={2 - i};t=60'
        assert r.headers["x-app"] == "1"
    refused = responses[3]
    assert refused.headers["retry-after"] == "60"
    assert refused.headers["content-type"] == "application/problem+json"
    body = refused.json()
    assert body["status"] == 429
    assert body["violated"] == [
        {"policy": "api", "level": "client", "limit": 3, "window": 60.0, "reset_after": 60}
    ]
    assert body["level"] == "client"
    assert "x-app" not in refused.headers


async def test_a_gcra_limit_reports_its_bucket_and_when_a_unit_comes_back(
    pool: KeyPool, clock: ManualClock
) -> None:
    # 6 per minute (one unit per 10 s), a bucket of 3: three at once, then one per 10 s.
    bucket = Limit(6, 60, name="b", algorithm="gcra", burst=3)
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(bucket))
    async with client(app) as c:
        responses = [await c.get("/x") for _ in range(4)]
        assert [r.status_code for r in responses] == [200, 200, 200, 429]
        # t: when the next unit comes back, 10 s after the first was taken.
        assert [r.headers["ratelimit"] for r in responses] == [
            '"b";r=2;t=10',
            '"b";r=1;t=10',
            '"b";r=0;t=10',
            '"b";r=0;t=10',
        ]
        assert {r.headers["ratelimit-policy"] for r in responses} == {'"b";q=3;w=30'}
        assert responses[2].headers["x-ratelimit-limit"] == "3"
        assert responses[2].headers["x-ratelimit-reset"] == str(int(WALL + 30))  # whole again
        refused = responses[3]
        assert refused.headers["retry-after"] == "10"
        assert refused.json()["violated"] == [
            {"policy": "b", "level": "client", "limit": 3, "window": 30.0, "reset_after": 10}
        ]
        clock.advance(10.0)
        again = await c.get("/x")
        assert (again.status_code, again.headers["ratelimit"]) == (200, '"b";r=0;t=10')


async def test_a_sliding_limit_counts_the_previous_window_by_its_overlap(
    pool: KeyPool, clock: ManualClock
) -> None:
    app = RateLimitMiddleware(
        hello, pool=pool, rules=Rule(Limit(4, 60, name="s", algorithm="sliding"))
    )
    async with client(app) as c:
        assert [(await c.get("/x")).status_code for _ in range(5)] == [200] * 4 + [429]
        clock.advance(60.0)  # the full window is now the previous one, weighed in whole
        refused = await c.get("/x")
        assert (refused.status_code, refused.headers["retry-after"]) == (429, "15")
        assert refused.headers["ratelimit"] == '"s";r=0;t=15'
        clock.advance(15.0)  # a quarter of it has slid out: one unit back
        assert [(await c.get("/x")).status_code for _ in range(2)] == [200, 429]


@pytest.mark.parametrize(
    ("style", "fields"),
    [
        ("ietf", {"ratelimit-policy", "ratelimit"}),
        ("x-ratelimit", {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"}),
        ("none", set()),
    ],
)
async def test_headers_choose_the_fields_and_a_refusal_keeps_retry_after(
    pool: KeyPool, style: Any, fields: set[str]
) -> None:
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60, name="api")), headers=style)
    async with client(app) as c:
        allowed, refused = [await c.get("/x") for _ in range(2)]
    rate_fields = {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"}
    rate_fields |= {"ratelimit-policy", "ratelimit", "retry-after"}
    assert (allowed.status_code, refused.status_code) == (200, 429)
    assert rate_fields & set(allowed.headers) == fields
    assert rate_fields & set(refused.headers) == fields | {"retry-after"}
    assert refused.headers["retry-after"] == "60"
    assert allowed.headers["x-app"] == "1"


async def test_retry_after_is_whole_seconds_never_early(pool: KeyPool, clock: ManualClock) -> None:
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 10)))
    async with client(app) as c:
        await c.get("/")
        clock.advance(9.6)  # 0.4 s left
        r = await c.get("/")
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.headers["ratelimit"].endswith(";t=1")


async def test_several_limits_all_or_nothing(pool: KeyPool, clock: ManualClock) -> None:
    rule = Rule([Limit(2, 1, name="burst"), Limit(3, 3600, name="hour")])
    app = RateLimitMiddleware(hello, pool=pool, rules=rule)
    async with client(app) as c:
        first = [await c.get("/") for _ in range(3)]
        clock.advance(1.0)
        second = [await c.get("/") for _ in range(2)]
    assert [r.status_code for r in first] == [200, 200, 429]
    # The third request was refused by "burst" and consumed nothing of "hour".
    assert [r.status_code for r in second] == [200, 429]
    assert first[0].headers["ratelimit-policy"] == '"burst";q=2;w=1, "hour";q=3;w=3600'
    assert first[2].headers["ratelimit"] == '"burst";r=0;t=1, "hour";r=1;t=3600'
    last = second[1]
    assert last.headers["x-ratelimit-limit"] == "3"
    assert last.headers["retry-after"] == "3599"
    assert [v["policy"] for v in last.json()["violated"]] == ["hour"]


async def test_exempt_and_unselected_requests_consume_nothing(pool: KeyPool) -> None:
    rules = [Rule(Limit(1, 60), path="/api", methods=["POST"], name="writes")]
    app = RateLimitMiddleware(hello, pool=pool, rules=rules, exempt=("/api/health", "/static/"))
    async with client(app) as c:
        for _ in range(3):
            for r in (
                await c.get("/api/x"),
                await c.post("/api/health"),
                await c.post("/static/app.js"),
                await c.post("/apiary"),
            ):
                assert r.status_code == 200
                assert "x-ratelimit-limit" not in r.headers
        assert (await c.post("/api/orders")).status_code == 200
        assert (await c.post("/api")).status_code == 429


async def test_predicates_exempt_staff_and_an_internal_network(
    pool: KeyPool, tmp_path: Path
) -> None:
    import ipaddress

    internal = ipaddress.ip_network("10.9.0.0/16")
    asked: list[str] = []

    def from_inside(scope: Scope) -> bool:
        asked.append(scope["path"])
        return ipaddress.ip_address(scope["client"][0]) in internal

    async def staff(scope: Scope) -> bool:  # an async predicate: awaited
        await asyncio.sleep(0)
        return dict(scope["headers"]).get(b"x-role") == b"staff"

    app = RateLimitMiddleware(
        hello,
        pool=pool,
        rules=Rule(Limit(1, 60), path="/api", name="api"),
        exempt=("/api/health", from_inside, staff),
    )
    async with client(app, "10.9.3.4") as inside, client(app, "192.0.2.1") as outside:
        assert [(await inside.get("/api/x")).status_code for _ in range(3)] == [200] * 3
        staffed = [await outside.get("/api/x", headers={"x-role": "staff"}) for _ in range(3)]
        assert [r.status_code for r in staffed] == [200] * 3
        assert "x-ratelimit-limit" not in staffed[0].headers
        assert [(await outside.get("/api/x")).status_code for _ in range(2)] == [200, 429]
        await outside.get("/api/health")
        await outside.get("/elsewhere")
    # Asked only for requests a rule selects and no path exempts.
    assert set(asked) == {"/api/x"}
    import sqlite3

    with sqlite3.connect(tmp_path / "porch.sqlite3") as db:
        rows = db.execute("SELECT key, count FROM counters").fetchall()
    assert [(key.rsplit("\x1f", 1)[1], count) for key, count in rows] == [("192.0.2.1", 1)]


async def test_an_exemption_that_is_neither_a_path_nor_callable_is_refused(
    pool: KeyPool,
) -> None:
    with pytest.raises(ConfigurationError, match="or be predicates"):
        RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60)), exempt=(3,))  # type: ignore[arg-type]


async def test_clients_are_counted_apart_and_ports_do_not_matter(pool: KeyPool) -> None:
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60)))
    async with client(app, "10.0.0.1") as a, client(app, "10.0.0.2") as b:
        assert (await a.get("/")).status_code == 200
        assert (await b.get("/")).status_code == 200
        assert (await a.get("/")).status_code == 429
    other_port = httpx.ASGITransport(app=app, client=("10.0.0.1", 50001))
    async with httpx.AsyncClient(transport=other_port, base_url="http://t") as a2:
        assert (await a2.get("/")).status_code == 429


async def test_custom_key_function(pool: KeyPool) -> None:
    def by_api_key(scope: Scope) -> str:
        headers: dict[bytes, bytes] = dict(scope["headers"])
        return headers.get(b"x-api-key", b"anon").decode()

    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60)), key=by_api_key)
    async with client(app) as c:
        assert (await c.get("/", headers={"x-api-key": "a"})).status_code == 200
        assert (await c.get("/", headers={"x-api-key": "b"})).status_code == 200
        assert (await c.get("/", headers={"x-api-key": "a"})).status_code == 429


async def test_trusted_proxy_key(pool: KeyPool) -> None:
    app = RateLimitMiddleware(
        hello, pool=pool, rules=Rule(Limit(1, 60)), key=ClientIdentity(trust_hops=1)
    )
    async with client(app, "10.9.9.9") as c:
        assert (await c.get("/", headers={"x-forwarded-for": "1.1.1.1"})).status_code == 200
        assert (await c.get("/", headers={"x-forwarded-for": "2.2.2.2"})).status_code == 200
        assert (await c.get("/", headers={"x-forwarded-for": "1.1.1.1"})).status_code == 429


async def test_dry_run_counts_and_reports_but_never_refuses(pool: KeyPool) -> None:
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(2, 60)), dry_run=True)
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.headers["x-ratelimit-remaining"] for r in responses] == ["1", "0", "0", "0"]
    assert "retry-after" in responses[3].headers


async def test_custom_refusal_factory(pool: KeyPool) -> None:
    seen: list[Refusal] = []

    def teapot(scope: Scope, refusal: Refusal) -> ASGIApp:
        seen.append(refusal)
        return BytesResponse(418, b"slow down", [(b"content-type", b"text/plain")])

    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60)), on_refused=teapot)
    async with client(app) as c:
        await c.get("/")
        r = await c.get("/")
    assert (r.status_code, r.text) == (418, "slow down")
    assert r.headers["retry-after"] == "60"
    assert seen[0].key == "10.1.1.1"
    assert seen[0].violated[0].limit == 1


class BrokenStore:
    claims: Claims = NoClaims()
    capabilities = Capabilities()
    secret = b"s" * 32

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        raise StoreError("database is locked")

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(0, 0, 0)


async def test_store_failure_fails_closed_by_default(caplog: pytest.LogCaptureFixture) -> None:
    async with KeyPool(BrokenStore()) as pool:
        app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(5, 60)))
        async with client(app) as c:
            r = await c.get("/")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["cause"] == "store"
    assert "rate limit store failed" in caplog.text


async def test_fail_open_is_explicit() -> None:
    async with KeyPool(BrokenStore()) as pool:
        app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(5, 60)), fail_open=True)
        async with client(app) as c:
            r = await c.get("/")
    assert (r.status_code, r.text) == (200, "hello")
    assert "x-ratelimit-limit" not in r.headers


class SlowStore(BrokenStore):
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.applied = 0

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        await self.gate.wait()
        for op in ops:
            assert isinstance(op, Hit)
            op.allowed = True
            op.fits = [True]
            op.remaining = [99]
            op.next = op.full = op.retry = [60.0]
            op.stamp = [0.0]
        self.applied += len(ops)


async def test_saturation_is_503_and_never_runs_the_app() -> None:
    ran = 0

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal ran
        ran += 1
        await hello(scope, receive, send)

    store = SlowStore()
    async with KeyPool(store, size=1, mailbox=2) as pool:
        app = RateLimitMiddleware(counting, pool=pool, rules=Rule(Limit(100, 60)))
        async with client(app) as c:
            tasks = [asyncio.create_task(c.get("/")) for _ in range(10)]

            def all_sent() -> bool:
                stats = pool.statistics()
                return stats.calls + stats.saturations == 10  # queued or refused

            await until(all_sent, "every request reached the pool")
            store.gate.set()
            responses = await asyncio.gather(*tasks)
    codes = [r.status_code for r in responses]
    assert codes.count(503) >= 1
    assert codes.count(200) == ran == store.applied
    saturated = next(r for r in responses if r.status_code == 503)
    assert saturated.json()["cause"] == "saturated"
    assert saturated.headers["retry-after"] == "1"


async def test_non_http_scopes_pass_through(pool: KeyPool) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    mw = RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(1, 60)))

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        pass

    await mw({"type": "websocket", "path": "/ws", "headers": []}, receive, send)
    assert seen == ["websocket"]
    assert not pool.started


async def test_lifespan_opens_and_closes_the_pool(pool: KeyPool) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return

    mw = RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(1, 60)))
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[dict[str, Any]] = []

    async def send(message: Message) -> None:
        sent.append({"type": message["type"], "started": pool.started})

    await inbox.put({"type": "lifespan.startup"})
    await inbox.put({"type": "lifespan.shutdown"})
    await mw({"type": "lifespan"}, inbox.get, send)
    assert sent == [
        {"type": "lifespan.startup.complete", "started": True},
        {"type": "lifespan.shutdown.complete", "started": False},
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rules": []}, "needs at least one Rule"),
        ({"rules": [Rule(Limit(1, 1)), Rule(Limit(2, 1))]}, "rule names must be unique"),
        ({"exempt": ("health",)}, "exempt paths must start with '/'"),
        ({"retry_after_saturated": 0}, "retry_after_saturated must be >= 1"),
        (
            {"headers": "X-RateLimit"},
            r"headers must be one of \('both', 'ietf', 'x-ratelimit', 'none'\), got 'X-RateLimit'",
        ),
    ],
)
def test_configuration_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"rules": Rule(Limit(1, 1))} | kwargs
    with pytest.raises(ConfigurationError, match=message):
        RateLimitMiddleware(hello, pool=KeyPool(SQLiteStore(tmp_path)), **settings)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Limit(0, 1), "limit amount must be an integer >= 1, got 0"),
        (lambda: Limit(True, 1), "limit amount must be an integer >= 1, got True"),
        (lambda: Limit(1, 0), "limit window must be > 0 seconds, got 0"),
        (lambda: Limit(1, float("inf")), "limit window must be > 0 seconds, got inf"),
        (lambda: Limit(1, 1, name='a"b'), "limit name must be 1-64 characters"),
        (lambda: Rule([]), "a rule needs at least one Limit"),
        (lambda: Rule([Limit(1, 1), Limit(2, 1, name="1-per-1s")]), "limit names within a rule"),
        (lambda: Rule(Limit(1, 1), path="api"), "rule path must start with '/'"),
        (lambda: Rule(Limit(1, 1), name="a b"), "rule name must be 1-64 characters"),
    ],
)
def test_limit_and_rule_validation(build: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        build()


def test_limit_default_name() -> None:
    assert Limit(10, 1).name == "10-per-1s"
    assert Limit(1000, 86400.0).name == "1000-per-86400s"
    assert json.dumps(Rule(Limit(1, 1), path="/api/").path) == '"/api"'


async def test_an_unreadable_store_is_503_not_a_dead_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "porch.sqlite3"
    bad.write_bytes(b"not a database at all" * 200)
    pool = KeyPool(SQLiteStore(tmp_path))
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(5, 60)))

    # Lifespan still completes: the server serves, and fails closed.
    sent: list[str] = []

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        sent.append(message["type"])

    async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})

    await RateLimitMiddleware(lifespan_app, pool=pool, rules=Rule(Limit(5, 60)))(
        {"type": "lifespan"}, receive, send
    )
    assert sent == ["lifespan.startup.complete"]
    assert "cannot open the store" in caplog.text
    try:
        async with client(app) as c:
            first = await c.get("/")
            assert first.status_code == 503
            assert first.json()["cause"] == "store"
            # The file is repaired: after the retry interval the store opens.
            bad.unlink()
            assert (await c.get("/")).status_code == 503  # within the interval: fail fast
            await asyncio.sleep(1.05)
            assert (await c.get("/")).status_code == 200
    finally:
        await pool.close()


async def test_rules_and_exemptions_match_the_path_inside_a_mount(pool: KeyPool) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    sub = RateLimitMiddleware(
        hello, pool=pool, rules=Rule(Limit(3, 60), path="/orders"), exempt=("/health",)
    )
    app = Starlette(routes=[Mount("/v1", app=sub)])
    async with client(app) as c:
        orders = [(await c.get("/v1/orders")).status_code for _ in range(4)]
        health = [(await c.get("/v1/health")).status_code for _ in range(4)]
        other = (await c.get("/v1/products")).headers
    assert orders == [200, 200, 200, 429]
    assert health == [200] * 4
    assert "x-ratelimit-limit" not in other  # /orders only, as the sub-app sees paths


@pytest.mark.parametrize(
    ("path", "root_path", "expected"),
    [
        ("/v1/orders", "/v1", "/orders"),
        ("/v1", "/v1", "/"),
        ("/v10/orders", "/v1", "/v10/orders"),  # not below the mount: the whole path
        ("/orders", "", "/orders"),
        ("/orders", "/v1", "/orders"),  # a server that left the prefix out of path
    ],
)
def test_route_path_is_path_less_root_path(path: str, root_path: str, expected: str) -> None:
    from porch._asgi import route_path

    assert route_path({"path": path, "root_path": root_path}) == expected


async def test_porch_answers_the_lifespan_for_an_app_without_one(tmp_path: Path) -> None:
    """Django's ASGI handler raises on a lifespan scope: porch answers it for its pool, so the
    pool opens at startup and closes when the server stops."""

    async def django_like(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}")
        await hello(scope, receive, send)

    pool = KeyPool(SQLiteStore(tmp_path))
    app = RateLimitMiddleware(django_like, pool=pool, rules=Rule(Limit(3, 60)))
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[str] = []

    async def send(message: Message) -> None:
        sent.append(message["type"])

    serving = asyncio.create_task(app({"type": "lifespan"}, inbox.get, send))
    await inbox.put({"type": "lifespan.startup"})
    await until(lambda: sent == ["lifespan.startup.complete"])
    assert pool.started
    await inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(serving, 10)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert not pool.started
    assert not (tmp_path / "porch.sqlite3-wal").exists()


async def test_an_async_key_function_and_what_the_apps_auth_left_in_the_scope(
    pool: KeyPool, tmp_path: Path
) -> None:
    """The app's authentication runs first and leaves the user in scope["state"]; an async
    key function looks an API key up (a database, here a dict behind an await)."""
    keys = {b"k-1": "acct-1", b"k-2": "acct-1", b"k-3": "acct-2"}  # two keys, one account

    async def account(scope: Scope) -> str:
        await asyncio.sleep(0)  # the database round trip
        api_key = dict(scope["headers"]).get(b"x-api-key", b"")
        return keys.get(api_key, "anonymous")

    def authenticated(app: ASGIApp) -> ASGIApp:
        async def auth(scope: Scope, receive: Receive, send: Send) -> None:
            # Decoded once (a JWT, say): the key function reads it, never the header again.
            token = dict(scope["headers"]).get(b"authorization", b"Bearer nobody")
            scope.setdefault("state", {})["user"] = token.split()[-1].decode()
            await app(scope, receive, send)

        return auth

    def user(scope: Scope) -> str:
        return "user:" + str(scope["state"]["user"])

    by_account = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(2, 60)), key=account)
    by_user = authenticated(
        RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(1, 60), name="u"), key=user)
    )
    async with client(by_account) as c:
        shared = [await c.get("/", headers={"x-api-key": k}) for k in ("k-1", "k-2", "k-1")]
        other = await c.get("/", headers={"x-api-key": "k-3"})
    assert [r.status_code for r in shared] == [200, 200, 429]  # one account's two keys
    assert other.status_code == 200
    async with client(by_user) as c:
        alice = [await c.get("/", headers={"authorization": "Bearer alice"}) for _ in range(2)]
        bob = await c.get("/", headers={"authorization": "Bearer bob"})
    assert [r.status_code for r in alice] == [200, 429]
    assert bob.status_code == 200
