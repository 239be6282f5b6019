"""The middleware's policies on the embedded store: costs, reserve and settle, levels, plans.

Counts come from the SQLite rows; time moves on a manual clock both the store and the
middleware read. The algorithms' arithmetic is the conformance suite's
(tests/store/conformance/); here, what a request costs, under which keys, with which
limits, and what the client is told.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from porch import (
    Concurrency,
    ConfigurationError,
    ForwardingHeaderError,
    KeyPool,
    Limit,
    ManualClock,
    Plans,
    RateLimitMiddleware,
    Rule,
)
from porch._types import Message, Receive, Scope, Send
from porch.ratelimit import CostRequest, settle
from support import asgi_client as client
from support import sqlite_counters

pytestmark = pytest.mark.anyio

US = "\x1f"


def counters(tmp_path: Path) -> dict[str, int]:
    return sqlite_counters(tmp_path, nonzero=True)


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the body it received (so a body read for the cost must reach it)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def used_by(scope: Scope) -> int:
    """What the demo-like handlers below used: the 'used' query parameter."""
    query = dict(p.split("=") for p in scope["query_string"].decode().split("&") if p)
    return int(query.get("used", "0"))


async def settling(scope: Scope, receive: Receive, send: Send) -> None:
    """Reports what it used (?used=N), then answers; ?fail=before|after raises."""
    query = scope["query_string"].decode()
    if "fail=before" in query:
        raise RuntimeError("the handler failed before it knew what it used")
    settle(scope, used_by(scope))
    if "fail=after" in query:
        raise RuntimeError("the handler failed after it reported")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})


# -- cost --------------------------------------------------------------------------------


async def test_a_static_cost_consumes_that_many_units(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(echo, pool=pool, rules=Rule(Limit(10, 60, name="t"), cost=3))
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining"] for r in responses] == ["7", "4", "1", "1"]
    assert counters(tmp_path) == {f"rl{US}default{US}t{US}10.1.1.1": 9}


async def test_a_cost_function_reads_the_json_body_and_the_app_still_gets_it(
    pool: KeyPool, tmp_path: Path
) -> None:
    async def tokens(request: CostRequest) -> int:
        data = await request.json()
        return int(data["max_tokens"])

    app = RateLimitMiddleware(echo, pool=pool, rules=Rule(Limit(100, 60, name="t"), cost=tokens))
    async with client(app) as c:
        first = await c.post("/", json={"max_tokens": 60})
        second = await c.post("/", json={"max_tokens": 50})  # 110 > 100: refused
        third = await c.post("/", json={"max_tokens": 40})  # a smaller one still fits
    assert first.status_code == 200
    assert first.json() == {"max_tokens": 60}  # the body read for the cost reached the app
    assert second.status_code == 429
    assert (third.status_code, third.headers["x-ratelimit-remaining"]) == (200, "0")
    assert counters(tmp_path) == {f"rl{US}default{US}t{US}10.1.1.1": 100}


async def test_a_sync_cost_function_of_the_scope(pool: KeyPool, tmp_path: Path) -> None:
    def by_header(request: CostRequest) -> int:
        return int(dict(request.scope["headers"]).get(b"x-units", b"1"))

    app = RateLimitMiddleware(echo, pool=pool, rules=Rule(Limit(5, 60, name="t"), cost=by_header))
    async with client(app) as c:
        assert (await c.get("/", headers={"x-units": "4"})).status_code == 200
        assert (await c.get("/", headers={"x-units": "2"})).status_code == 429
        assert (await c.get("/", headers={"x-units": "0"})).status_code == 200  # costs nothing
    assert counters(tmp_path) == {f"rl{US}default{US}t{US}10.1.1.1": 4}


async def test_a_cost_that_cannot_be_read_is_a_precise_4xx_and_consumes_nothing(
    pool: KeyPool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def tokens(request: CostRequest) -> Any:
        data = await request.json(max_bytes=64)
        return data["n"] if "n" in data else data["missing"]

    app = RateLimitMiddleware(echo, pool=pool, rules=Rule(Limit(100, 60), cost=tokens))
    async with client(app) as c:
        not_json = await c.post("/", content=b"{nope")
        too_big = await c.post("/", json={"n": 1, "pad": "x" * 100})
        negative = await c.post("/", json={"n": -5})
        not_int = await c.post("/", json={"n": 2.5})
    assert not_json.status_code == 400
    assert not_json.json()["cause"] == "cost"
    assert not_json.json()["detail"].startswith("the request's cost cannot be read: ")
    assert (too_big.status_code, too_big.json()["detail"]) == (
        413,
        "a request body may be at most 64 bytes",
    )
    assert (negative.status_code, negative.json()["detail"]) == (
        400,
        "the request's cost must be an integer >= 0, got -5",
    )
    assert not_int.status_code == 400
    assert counters(tmp_path) == {}
    assert "cost" in caplog.text


async def test_a_refusal_remembered_at_a_high_cost_does_not_refuse_a_cheaper_request(
    pool: KeyPool,
) -> None:
    def units(request: CostRequest) -> int:
        return int(dict(request.scope["headers"])[b"x-units"])

    app = RateLimitMiddleware(echo, pool=pool, rules=Rule(Limit(10, 60), cost=units))
    async with client(app) as c:
        assert (await c.get("/", headers={"x-units": "6"})).status_code == 200
        assert (await c.get("/", headers={"x-units": "8"})).status_code == 429  # remembered
        assert (await c.get("/", headers={"x-units": "9"})).status_code == 429  # from memory
        assert (await c.get("/", headers={"x-units": "4"})).status_code == 200  # fits: asked


# -- reserve, then settle ----------------------------------------------------------------


def reserve(request: CostRequest) -> int:
    return int(dict(request.scope["headers"]).get(b"x-reserve", b"0"))


async def test_a_settle_refunds_or_charges_the_difference_after_the_response(
    pool: KeyPool, tmp_path: Path
) -> None:
    rule = Rule(Limit(100, 60, name="tokens"), cost=reserve, settle=True)
    app = RateLimitMiddleware(settling, pool=pool, rules=rule)
    key = f"rl{US}default{US}tokens{US}10.1.1.1"
    async with client(app) as c:
        # Reserved 80, used 30: 50 refunded once the response went.
        response = await c.get("/?used=30", headers={"x-reserve": "80"})
        assert response.headers["x-ratelimit-remaining"] == "20"  # told at the reservation
        assert counters(tmp_path) == {key: 30}
        # Reserved 50, used 90: 40 more charged, past the amount (a debt)...
        assert (await c.get("/?used=90", headers={"x-reserve": "50"})).status_code == 200
        assert counters(tmp_path) == {key: 120}
        # ...so even a free request is refused until the window ends.
        refused = await c.get("/?used=0", headers={"x-reserve": "0"})
        assert (refused.status_code, refused.headers["x-ratelimit-remaining"]) == (429, "0")


async def test_what_a_failing_handler_or_a_departed_client_settles(
    pool: KeyPool, tmp_path: Path
) -> None:
    rule = Rule(Limit(1000, 60, name="tokens"), cost=reserve, settle=True)
    app = RateLimitMiddleware(settling, pool=pool, rules=rule)
    key = f"rl{US}default{US}tokens{US}10.1.1.1"
    async with client(app) as c:
        with pytest.raises(RuntimeError, match="before"):
            await c.get("/?used=5&fail=before", headers={"x-reserve": "100"})
        assert counters(tmp_path) == {key: 100}  # never reported: the estimate stands
        with pytest.raises(RuntimeError, match="after"):
            await c.get("/?used=5&fail=after", headers={"x-reserve": "100"})
        assert counters(tmp_path) == {key: 105}  # reported, then raised: settled

    async def departed(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "http.disconnect"  # gone before the handler knew its cost

    app = RateLimitMiddleware(departed, pool=pool, rules=rule)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "raw_path": b"/",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"x-reserve", b"100")],
        "client": ("10.1.1.1", 40000),
    }
    sent: list[Message] = []

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, gone, send)
    assert sent == []
    assert counters(tmp_path) == {key: 205}


async def test_settle_goes_to_the_rules_that_reserve(pool: KeyPool, tmp_path: Path) -> None:
    taken: list[bool] = []

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        taken.append(settle(scope, 7, rule="nobody"))
        taken.append(settle(scope, 7))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    inner = RateLimitMiddleware(
        handler, pool=pool, rules=Rule("100/minute", name="tokens", cost=20, settle=True)
    )
    # The outer limiter counts requests, one each, and reserves nothing: it keeps its 1.
    app = RateLimitMiddleware(inner, pool=pool, rules=Rule("10/minute", name="requests"))
    async with client(app) as c:
        assert (await c.get("/")).status_code == 200
    assert taken == [False, True]
    assert counters(tmp_path) == {
        f"rl{US}requests{US}10-per-60s{US}10.1.1.1": 1,
        f"rl{US}tokens{US}100-per-60s{US}10.1.1.1": 7,
    }
    # Outside any limiter (an exempt path, the limiter off): nothing to settle.
    assert settle({"type": "http"}, 5) is False
    with pytest.raises(ValueError, match="an integer >= 0, got -1"):
        settle({"type": "http"}, -1)
    with pytest.raises(TypeError, match="a request or its ASGI scope"):
        settle(object(), 1)


async def test_a_refund_forgets_a_remembered_refusal(pool: KeyPool) -> None:
    entered, go = asyncio.Event(), asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            entered.set()
            await go.wait()  # a long completion holding its reservation
        await settling(scope, receive, send)

    rule = Rule(Limit(10, 60, name="t"), cost=reserve, settle=True)
    app = RateLimitMiddleware(slow, pool=pool, rules=rule)
    async with client(app) as c:
        holding = asyncio.create_task(c.get("/slow?used=0", headers={"x-reserve": "5"}))
        await asyncio.wait_for(entered.wait(), 10)
        refused = await c.get("/?used=0", headers={"x-reserve": "6"})  # 5 + 6 > 10
        assert refused.status_code == 429  # remembered: a 6 would be refused from memory
        go.set()
        assert (await holding).status_code == 200  # used nothing: its 5 came back
        assert (await c.get("/?used=6", headers={"x-reserve": "6"})).status_code == 200


async def test_a_cap_and_a_settled_cost_in_one_rule(pool: KeyPool, tmp_path: Path) -> None:
    # A token budget with one completion of a client in flight at a time.
    entered, go = asyncio.Event(), asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            entered.set()
            await go.wait()
        await settling(scope, receive, send)

    rule = Rule(
        [Limit(100, 60, name="tokens"), Concurrency(1, name="one")], cost=reserve, settle=True
    )
    app = RateLimitMiddleware(slow, pool=pool, rules=rule)
    async with client(app) as c:
        holding = asyncio.create_task(c.get("/slow?used=10", headers={"x-reserve": "50"}))
        await asyncio.wait_for(entered.wait(), 10)
        busy = await c.get("/?used=1", headers={"x-reserve": "1"})
        go.set()
        assert (await holding).status_code == 200
        after = await c.get("/?used=1", headers={"x-reserve": "1"})
    assert (busy.status_code, busy.headers["retry-after"]) == (429, "1")
    assert busy.json()["violated"] == [
        {
            "policy": "one",
            "level": "client",
            "limit": 1,
            "unit": "concurrent-requests",
            "remaining": 0,
            "reset_after": 1,
        }
    ]
    assert after.status_code == 200
    # The refused request consumed nothing; the two served settled to what they used.
    assert counters(tmp_path)[f"rl{US}default{US}tokens{US}10.1.1.1"] == 11


# -- levels ------------------------------------------------------------------------------


async def test_levels_decide_all_or_nothing_and_the_refusal_names_the_level(
    pool: KeyPool, tmp_path: Path
) -> None:
    rule = Rule(
        [Limit(2, 60, name="client"), Limit(3, 60, name="global", level="global")], name="r"
    )
    app = RateLimitMiddleware(echo, pool=pool, rules=rule)
    async with client(app, "10.0.0.1") as a, client(app, "10.0.0.2") as b:
        assert [(await a.get("/")).status_code for _ in range(2)] == [200, 200]
        by_client = await a.get("/")
        assert (await b.get("/")).status_code == 200  # the third of everyone's three
        by_global = await b.get("/")
    assert by_client.status_code == by_global.status_code == 429
    assert by_client.json()["level"] == "client"
    assert by_global.json()["level"] == "global"
    assert [p["level"] for p in by_global.json()["violated"]] == ["global"]
    # The headers report the tightest limit: for b, the global one (0 left).
    assert by_global.headers["x-ratelimit-limit"] == "3"
    assert by_global.headers["ratelimit"] == '"client";r=1;t=60, "global";r=0;t=60'
    # Refused hits consumed nothing at either level.
    assert counters(tmp_path) == {
        f"rl{US}r{US}client{US}10.0.0.1": 2,
        f"rl{US}r{US}client{US}10.0.0.2": 1,
        f"rl{US}r{US}global{US}": 3,
    }


async def test_a_declared_level_with_an_async_key_and_one_that_does_not_apply(
    pool: KeyPool, tmp_path: Path
) -> None:
    orgs = {"10.0.0.1": "acme", "10.0.0.2": "acme"}

    async def org_of(scope: Scope) -> str | None:
        await asyncio.sleep(0)  # a lookup
        return orgs.get(scope["client"][0])

    rule = Rule([Limit(5, 60), Limit(3, 60, level="org")], name="r", levels={"org": org_of})
    assert [limit.name for limit in rule.limits] == ["5-per-60s", "org:3-per-60s"]
    app = RateLimitMiddleware(echo, pool=pool, rules=rule)
    async with (
        client(app, "10.0.0.1") as a,
        client(app, "10.0.0.2") as b,
        client(app, "10.0.0.3") as loner,
    ):
        statuses = [(await c.get("/")).status_code for c in (a, b, a, b)]
        refused = await b.get("/")
        alone = await loner.get("/")
    assert statuses == [200, 200, 200, 429]
    assert refused.json()["level"] == "org"
    # No organisation: only the client's limit applies, and only it is announced.
    assert alone.headers["ratelimit-policy"] == '"5-per-60s";q=5;w=60'
    assert counters(tmp_path) == {
        f"rl{US}r{US}5-per-60s{US}10.0.0.1": 2,
        f"rl{US}r{US}5-per-60s{US}10.0.0.2": 1,
        f"rl{US}r{US}5-per-60s{US}10.0.0.3": 1,
        f"rl{US}r{US}org:3-per-60s{US}acme": 3,
    }


async def test_a_level_key_that_cannot_be_found_is_400(pool: KeyPool, tmp_path: Path) -> None:
    def org_of(scope: Scope) -> str:
        raise ForwardingHeaderError("no trusted organisation header")

    rule = Rule([Limit(5, 60), Limit(3, 60, level="org")], levels={"org": org_of})
    app = RateLimitMiddleware(echo, pool=pool, rules=rule)
    async with client(app) as c:
        response = await c.get("/")
    assert (response.status_code, response.json()["cause"]) == (400, "forwarding")
    assert counters(tmp_path) == {}


# -- plans -------------------------------------------------------------------------------


async def test_plans_come_from_a_function_cached_per_key_and_usage_carries_over(
    pool: KeyPool, tmp_path: Path, clock: ManualClock
) -> None:
    subscriptions = {"k1": "free"}
    lookups: list[str] = []

    async def plan_of(scope: Scope) -> str | None:
        key = dict(scope["headers"]).get(b"x-api-key", b"").decode()
        lookups.append(key)
        return subscriptions.get(key)

    def api_key(scope: Scope) -> str:
        found: bytes = dict(scope["headers"]).get(b"x-api-key", b"anonymous")
        return found.decode()

    plans = Plans({"free": "3/minute", "pro": "10/minute"}, plan=plan_of, cache=30)
    app = RateLimitMiddleware(
        echo, pool=pool, rules=Rule("1/minute", name="api", plans=plans), key=api_key
    )
    async with client(app, **{"x-api-key": "k1"}) as c:
        statuses = [(await c.get("/")).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429]
        assert lookups == ["k1"]  # looked up once, then cached
        subscriptions["k1"] = "pro"  # an upgrade...
        still = await c.get("/")  # ...takes effect within the cache time, not at once
        clock.advance(30)
        upgraded = await c.get("/")
    assert still.status_code == 429
    assert upgraded.status_code == 200
    assert lookups == ["k1", "k1"]
    # The 3 used on free counted on pro: 10 - 4 = 6 left, not 9.
    assert upgraded.headers["ratelimit"] == '"per-60s";r=6;t=30'
    assert upgraded.headers["ratelimit-policy"] == '"per-60s";q=10;w=60'
    async with client(app) as anonymous:  # no plan: the rule's own limits
        assert [(await anonymous.get("/")).status_code for _ in range(2)] == [200, 429]
    assert counters(tmp_path) == {
        f"rl{US}api{US}per-60s{US}k1": 4,
        f"rl{US}api{US}per-60s{US}anonymous": 1,
    }


async def test_a_plan_that_is_no_plan_gets_the_rules_limits_and_a_log_line(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    plans = Plans({"pro": "10/minute"}, plan=lambda scope: "gold", cache=0)
    app = RateLimitMiddleware(echo, pool=pool, rules=Rule("1/minute", plans=plans))
    with caplog.at_level(logging.ERROR, logger="porch.ratelimit"):
        async with client(app) as c:
            assert [(await c.get("/")).status_code for _ in range(2)] == [200, 429]
    assert "returned 'gold', which is no plan (pro)" in caplog.text


async def test_named_limits_keep_their_own_counters_across_plans() -> None:
    plans = Plans(
        {"free": [Limit(5, 60, name="minute")], "pro": ["50/minute", "1000/day sliding"]},
        plan=lambda scope: None,
    )
    rule = Rule("5/minute", plans=plans)
    assert [limit.name for limit in rule.limits] == ["per-60s"]
    assert [[limit.name for limit in found] for _, found in plans.plans] == [
        ["minute"],
        ["per-60s", "per-86400s-sliding"],
    ]


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Rule("1/s", cost=-1),
            "a rule's cost must be an integer >= 0 or a function of the request, got -1",
        ),
        (
            lambda: Rule("1/s", cost=True),
            "a rule's cost must be an integer >= 0 or a function of the request, got True",
        ),
        (
            lambda: Rule(Limit(1, 1, level="org")),
            "limit 'org:1-per-1s' counts under level 'org', which the rule does not declare;"
            " give its key: levels={'org': key}",
        ),
        (
            lambda: Rule("1/s", levels={"global": str}),
            "level 'global' is porch's own: 'client' counts under the middleware's key,"
            " 'global' under one key for everyone",
        ),
        (
            lambda: Rule("1/s", levels={"org": "acme"}),  # type: ignore[dict-item]
            "level 'org' needs a key function callable(scope) -> str | None, got 'acme'",
        ),
        (
            lambda: Limit(1, 1, level="a b"),
            "limit level must be 1-32 characters of A-Z a-z 0-9 _ -, got 'a b'",
        ),
        (
            lambda: Rule(
                [Limit(1, 1), Limit(2, 1, level="global"), Limit(3, 1, name="global:2-per-1s")]
            ),
            "limit names within a rule must be unique, got"
            " ['1-per-1s', 'global:2-per-1s', 'global:2-per-1s']",
        ),
        (lambda: Plans({}, plan=str), "plans must map plan names to limits, got {}"),
        (
            lambda: Plans({"a": "1/s"}, plan="a"),  # type: ignore[arg-type]
            "plan must be a callable(scope) -> str | None, got 'a'",
        ),
        (
            lambda: Plans({"a": "1/s"}, plan=str, cache=-1),
            "plans' cache must be >= 0 seconds, got -1",
        ),
        (
            lambda: Plans({"a": "1/minute; 2/minute"}, plan=str),
            "limit names within a rule (plan 'a') must be unique, got ['per-60s', 'per-60s']",
        ),
        (
            lambda: Rule("1/s", plans=Plans({"a": Limit(1, 1, level="org")}, plan=str)),
            "limit 'org:per-1s' counts under level 'org', which the rule does not declare;"
            " give its key: levels={'org': key}",
        ),
    ],
)
def test_bad_policies_are_refused_with_an_exact_message(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        make()
    assert str(info.value) == message


def test_default_names_of_levels() -> None:
    assert Limit(5, 60, level="global").name == "global:5-per-60s"
    assert Limit("5/minute sliding", level="org").name == "org:5-per-60s-sliding"
    assert Limit(5, 60, level="client").name == "5-per-60s"
    body = json.dumps({"level": Limit(1, 1, level="global").level})
    assert body == '{"level": "global"}'


async def test_a_websocket_handshake_has_no_body_to_read_for_its_cost(pool: KeyPool) -> None:
    bodies: list[bytes] = []

    async def body_cost(request: CostRequest) -> int:
        bodies.append(await request.body())
        return 2

    received: list[Message] = []

    async def ws_app(scope: Scope, receive: Receive, send: Send) -> None:
        received.append(await receive())
        await send({"type": "websocket.accept"})

    rule = Rule(Limit(3, 60), websocket=True, cost=body_cost)
    app = RateLimitMiddleware(ws_app, pool=pool, rules=rule)
    scope = {"type": "websocket", "path": "/ws", "headers": [], "client": ("10.1.1.1", 1)}
    sent: list[Message] = []

    async def connect() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, connect, send)
    assert bodies == [b""]
    assert received == [{"type": "websocket.connect"}]  # the app's channel, untouched
    assert sent[0]["type"] == "websocket.accept"
