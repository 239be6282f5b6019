"""Concurrency caps in the limiter: a slot taken with the hit, held while the app runs,
freed before the last body chunk leaves, when the app raises, or when the request is
cancelled; the draft's fields for a cap; its refusals (Retry-After 1, never remembered)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from porch import (
    Concurrency,
    ConfigurationError,
    KeyPool,
    Limit,
    ManualClock,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch._types import Message, Receive, Scope, Send
from porch.store.base import Hit, StoreOp, Vacate
from support import asgi_client as client
from support import through_apply, until

pytestmark = pytest.mark.anyio

WALL = 1_700_000_000.0


class Handler:
    """An app whose requests wait, each, until the test lets them finish."""

    def __init__(self) -> None:
        self.entered = 0
        self.running = 0
        self.most = 0
        self.go = asyncio.Event()
        self.fail = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.entered += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.go.wait()
            if self.fail:
                raise RuntimeError("the handler failed")
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done"})
        finally:
            self.running -= 1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=500.0, wall=WALL)


@pytest.fixture
async def pool(tmp_path: Path, clock: ManualClock) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path, clock=clock))
    yield p
    await p.close()


async def in_flight(pool: KeyPool, key: str) -> int:
    """The store's count of requests in flight under ``key`` (a probe that takes nothing)."""
    probe = Hit([], [], [], slots=[key], caps=[1_000_000])
    await pool.store.apply([probe])
    await pool.store.apply([Vacate.of(probe)])
    return probe.in_flight[0] - 1


async def test_a_cap_lets_that_many_in_and_refuses_the_next_with_retry_after_1(
    pool: KeyPool,
) -> None:
    handler = Handler()
    app = RateLimitMiddleware(handler, pool=pool, rules=Rule(Concurrency(2, name="in-flight")))
    async with client(app) as c:
        first = [asyncio.ensure_future(c.post("/orders")) for _ in range(2)]
        await until(lambda: handler.entered == 2, "two requests in the handler")
        refused = await c.post("/orders")
        handler.go.set()
        passed = await asyncio.gather(*first)
        after = await c.post("/orders")
    assert [r.status_code for r in passed] == [200, 200]
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["ratelimit-policy"] == '"in-flight";q=2;qu="concurrent-requests"'
    assert refused.headers["ratelimit"] == '"in-flight";r=0;t=1'
    assert refused.json()["level"] == "client"
    assert refused.json()["violated"] == [
        {
            "policy": "in-flight",
            "level": "client",
            "limit": 2,
            "unit": "concurrent-requests",
            "remaining": 0,
            "reset_after": 1,
        }
    ]
    # A cap has no window: the X-RateLimit-* fields describe rate limits only.
    assert "x-ratelimit-limit" not in refused.headers
    assert {r.headers["ratelimit"] for r in passed} == {
        '"in-flight";r=1;t=1',
        '"in-flight";r=0;t=1',
    }
    assert after.status_code == 200
    assert after.headers["ratelimit"] == '"in-flight";r=1;t=1'
    assert handler.most == 2
    assert await in_flight(pool, "rl\x1fdefault\x1fin-flight\x1f10.1.1.1") == 0


async def test_each_client_has_its_own_slots(pool: KeyPool) -> None:
    handler = Handler()
    app = RateLimitMiddleware(handler, pool=pool, rules=Rule(Concurrency(1)))
    async with client(app, "10.0.0.1") as one, client(app, "10.0.0.2") as two:
        held = [asyncio.ensure_future(c.get("/")) for c in (one, two)]
        await until(lambda: handler.entered == 2, "one request of each client in the handler")
        assert (await one.get("/")).status_code == 429
        handler.go.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def test_a_request_without_a_slot_consumes_no_rate_and_a_refused_rate_takes_no_slot(
    pool: KeyPool,
) -> None:
    handler = Handler()
    rule = Rule([Limit(2, 60, name="api"), Concurrency(1, name="one")])
    app = RateLimitMiddleware(handler, pool=pool, rules=rule)
    async with client(app) as c:
        holding = asyncio.ensure_future(c.get("/"))
        await until(lambda: handler.entered == 1)
        no_slot = await c.get("/")
        handler.go.set()
        first = await holding
        second = await c.get("/")  # the rate's second unit: the refusal consumed none
        over = await c.get("/")
    assert first.status_code == 200
    assert first.headers["ratelimit"] == '"api";r=1;t=60, "one";r=0;t=1'
    assert first.headers["ratelimit-policy"] == '"api";q=2;w=60, "one";q=1;qu="concurrent-requests"'
    assert first.headers["x-ratelimit-limit"] == "2"
    assert first.headers["x-ratelimit-remaining"] == "1"
    assert no_slot.status_code == 429
    assert no_slot.headers["retry-after"] == "1"
    assert no_slot.headers["ratelimit"] == '"api";r=1;t=60, "one";r=0;t=1'
    assert [p["policy"] for p in no_slot.json()["violated"]] == ["one"]
    assert second.status_code == 200
    assert over.status_code == 429
    assert over.headers["retry-after"] == "60"
    assert over.headers["ratelimit"] == '"api";r=0;t=60, "one";r=1;t=1'
    assert [p["policy"] for p in over.json()["violated"]] == ["api"]
    assert await in_flight(pool, "rl\x1fdefault\x1fone\x1f10.1.1.1") == 0


async def test_a_slot_refusal_is_not_remembered(pool: KeyPool) -> None:
    """A rate refusal is answered from memory until its window moves; a slot may free at
    any moment, so the next request asks the store again and passes."""
    handler = Handler()
    app = RateLimitMiddleware(
        handler, pool=pool, rules=Rule([Limit(100, 60), Concurrency(1)]), refusal_memory=30.0
    )
    async with client(app) as c:
        holding = asyncio.ensure_future(c.get("/"))
        await until(lambda: handler.entered == 1)
        assert (await c.get("/")).status_code == 429
        handler.go.set()
        await holding
        assert (await c.get("/")).status_code == 200


async def test_the_slot_is_free_before_the_last_body_chunk_leaves(pool: KeyPool) -> None:
    """A client that sends its next request once it has read a response must find the slot
    free: the vacate is committed before the last chunk is handed to the server."""
    key = "rl\x1fdefault\x1f1-in-flight\x1f10.1.1.1"
    seen: list[tuple[bool, int]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    limited = RateLimitMiddleware(app, pool=pool, rules=Rule(Concurrency(1)))

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            seen.append((message.get("more_body", False), await in_flight(pool, key)))

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    await pool.start()
    await limited(_scope(), receive, send)
    assert seen == [(True, 1), (False, 0)]


async def test_a_handler_that_raises_frees_its_slot(pool: KeyPool) -> None:
    handler = Handler()
    handler.fail = True
    handler.go.set()
    app = RateLimitMiddleware(handler, pool=pool, rules=Rule(Concurrency(1)))
    async with client(app) as c:
        for _ in range(3):
            with pytest.raises(RuntimeError, match="the handler failed"):
                await c.get("/")
    assert handler.entered == 3


async def test_a_cancelled_request_frees_its_slot(pool: KeyPool) -> None:
    """A server that cancels the request's task (its client disconnected, or it is shutting
    down) cancels the handler: the slot is freed all the same."""
    handler = Handler()
    app = RateLimitMiddleware(handler, pool=pool, rules=Rule(Concurrency(1)))

    async def receive() -> Message:
        await asyncio.Event().wait()  # the body never comes
        raise AssertionError

    async def send(message: Message) -> None:
        pass

    await pool.start()
    task = asyncio.ensure_future(app(_scope(), receive, send))
    await until(lambda: handler.entered == 1)
    key = "rl\x1fdefault\x1f1-in-flight\x1f10.1.1.1"
    assert await in_flight(pool, key) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: handler.running == 0)
    assert await in_flight(pool, key) == 0


class HeldStore(SQLiteStore):
    """Holds every batch until ``gate`` is set (``holding``: one waits)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        through_apply(self)
        self.gate = asyncio.Event()
        self.holding = False

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        if not self.gate.is_set():
            self.holding = True
            await asyncio.wait_for(self.gate.wait(), 30)
        await super().apply(ops)


async def test_a_request_cancelled_while_its_slot_is_being_taken_frees_it(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Cancelled while its hit is in the store: the slot the hit takes is freed when it
    commits (it was held for as long as the store lived: that client got 429 for good)."""
    store = HeldStore(tmp_path, clock=clock)
    handler = Handler()
    app = RateLimitMiddleware(handler, pool=(pool := KeyPool(store)), rules=Rule(Concurrency(1)))
    key = "rl\x1fdefault\x1f1-in-flight\x1f10.1.1.1"

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    async with pool:
        task = asyncio.ensure_future(app(_scope(), receive, send))
        await until(lambda: store.holding, "the hit reached the store")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.gate.set()
        await until(lambda: store.statistics().transactions >= 2, "the hit and its vacate")
        assert await in_flight(pool, key) == 0
        handler.go.set()
        async with client(app) as c:
            assert (await c.get("/")).status_code == 200
    assert handler.entered == 1


async def test_a_dry_run_counts_a_slot_refusal_and_lets_the_request_through(
    pool: KeyPool,
) -> None:
    handler = Handler()
    app = RateLimitMiddleware(handler, pool=pool, rules=Rule(Concurrency(1)), dry_run=True)
    async with client(app) as c:
        first = asyncio.ensure_future(c.get("/"))
        await until(lambda: handler.entered == 1)
        second = asyncio.ensure_future(c.get("/"))
        await until(lambda: handler.entered == 2)
        handler.go.set()
        responses = await asyncio.gather(first, second)
    assert [r.status_code for r in responses] == [200, 200]
    # The one that held a slot freed it; the one that had none freed nothing.
    assert await in_flight(pool, "rl\x1fdefault\x1f1-in-flight\x1f10.1.1.1") == 0


async def test_a_store_without_slots_is_refused_when_the_limiter_is_built(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path)
    store.capabilities = replace(store.capabilities, slots=False)
    with pytest.raises(ConfigurationError, match="needs a store that takes concurrency slots"):
        RateLimitMiddleware(_noop, pool=KeyPool(store), rules=Rule(Concurrency(2)))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Concurrency(0), "concurrency amount must be an integer >= 1, got 0"),
        (lambda: Concurrency(True), "concurrency amount must be an integer >= 1, got True"),
        (lambda: Concurrency(1, name="a b"), "concurrency name must be 1-64 characters"),
        (
            lambda: Rule([Limit(1, 1, name="x"), Concurrency(1, name="x")]),
            "limit names within a rule must be unique",
        ),
    ],
)
def test_concurrency_validation(build: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        build()


def test_a_rule_keeps_its_caps_apart_from_its_rates() -> None:
    rule = Rule(["5/minute", Concurrency(3), Limit(10, 1)])
    assert [limit.name for limit in rule.limits] == ["5-per-60s", "10-per-1s"]
    assert rule.concurrency == (Concurrency(3),)
    assert Concurrency(3).name == "3-in-flight"
    # Two rules sharing a name must agree on their caps too.
    assert Rule(Concurrency(3), name="n").signature() != Rule(Concurrency(4), name="n").signature()


async def _noop(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError


def _scope() -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "path": "/",
        "raw_path": b"/",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("10.1.1.1", 40000),
        "server": ("test", 80),
        "scheme": "http",
    }


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        (
            "both",
            {
                "x-ratelimit-limit": "5",
                "x-ratelimit-remaining": "4",
                "x-ratelimit-reset": str(int(WALL + 60)),
                "ratelimit-policy": '"api";q=5;w=60, "one";q=2;qu="concurrent-requests"',
                "ratelimit": '"api";r=4;t=60, "one";r=1;t=1',
            },
        ),
        (
            "ietf",
            {
                "ratelimit-policy": '"api";q=5;w=60, "one";q=2;qu="concurrent-requests"',
                "ratelimit": '"api";r=4;t=60, "one";r=1;t=1',
            },
        ),
        (
            "x-ratelimit",
            {
                "x-ratelimit-limit": "5",
                "x-ratelimit-remaining": "4",
                "x-ratelimit-reset": str(int(WALL + 60)),
            },
        ),
        ("none", {}),
    ],
)
async def test_each_header_style_with_a_cap(
    pool: KeyPool, style: Any, expected: dict[str, str]
) -> None:
    handler = Handler()
    handler.go.set()
    rule = Rule([Limit(5, 60, name="api"), Concurrency(2, name="one")])
    app = RateLimitMiddleware(handler, pool=pool, rules=rule, headers=style)
    # The same fields with a second rate limit (the general path): its items in between.
    wide = RateLimitMiddleware(
        handler,
        pool=pool,
        rules=Rule(
            [Limit(5, 60, name="api"), Limit(9, 60, name="b"), Concurrency(2, name="one")],
            name="wide",
        ),
        headers=style,
    )
    fields = (
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit-policy",
        "ratelimit",
    )
    async with client(app) as c, client(wide) as w:
        one = await c.get("/")
        two = await w.get("/")
    assert {k: v for k, v in one.headers.items() if k in fields} == expected
    general = {k: v for k, v in two.headers.items() if k in fields}
    if "ratelimit" in expected:
        assert general["ratelimit"] == '"api";r=4;t=60, "b";r=8;t=60, "one";r=1;t=1'
    assert {k: v for k, v in general.items() if k.startswith("x-")} == {
        k: v for k, v in expected.items() if k.startswith("x-")
    }
