"""Sliced limits (``Limit(slice=n)``): units a host leases from the store and gives out itself.

Counts come from the SQLite rows; time moves on a manual clock both the store and the
middleware read. Two middlewares on one pool are two hosts' books on one store (a rule
``shared=True`` counts on one counter for both). Across real hosts, on every store:
tests/e2e/test_gate_hosts.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from porch import (
    Concurrency,
    ConfigurationError,
    KeyPool,
    Limit,
    ManualClock,
    Plans,
    RateLimitMiddleware,
    Rule,
)
from porch._types import Receive, Scope, Send
from porch.demo.config import DemoConfig
from porch.ratelimit._slices import SliceBook
from porch.store.base import Hit
from support import asgi_client as client
from support import sqlite_counters, until

pytestmark = pytest.mark.anyio

US = "\x1f"
GLOBAL_KEY = f"rl{US}default{US}g{US}"


def counters(tmp_path: Path) -> dict[str, int]:
    return sqlite_counters(tmp_path, nonzero=True)


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def sliced(amount: int = 10, size: int = 4, *more: Limit, cost: int = 1) -> Rule:
    limit = Limit(amount, 60, name="g", level="global", slice=size)
    return Rule([*more, limit], cost=cost, shared=True)


async def test_a_slice_is_leased_once_and_given_out_here(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    # One lease of 4 units charged at the store; three given out here.
    assert counters(tmp_path) == {GLOBAL_KEY: 4}
    # What is left: the store's 6, and the 3, 2, 1 this host still holds.
    assert [r.headers["ratelimit"] for r in responses] == [f'"g";r={r};t=60' for r in (9, 8, 7)]
    assert responses[0].headers["ratelimit-policy"] == '"g";q=10;w=60'


async def test_never_more_than_the_amount_and_the_windows_last_units_are_leased(
    pool: KeyPool, tmp_path: Path
) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(12)]
    # 4 + 4, then the 2 left (less than a slice, enough for a request), then none.
    assert [r.status_code for r in responses] == [200] * 10 + [429] * 2
    assert counters(tmp_path) == {GLOBAL_KEY: 10}
    refused = responses[-1]
    assert refused.json()["level"] == "global"
    assert refused.headers["retry-after"] == "60"


async def test_two_hosts_together_never_exceed_it_and_what_they_hold_comes_back(
    pool: KeyPool, tmp_path: Path
) -> None:
    a = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    b = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    async with client(a) as ca, client(b) as cb:
        first = await ca.get("/")  # a leases 4, gives 1: holds 3
        rest = [await cb.get("/") for _ in range(8)]  # b leases 4, then the 2 left
    assert first.status_code == 200
    assert [r.status_code for r in rest] == [200] * 6 + [429] * 2
    # Every unit of the window is charged: 7 served, 3 held by a.
    assert counters(tmp_path) == {GLOBAL_KEY: 10}
    async with client(a) as ca:
        more = [await ca.get("/") for _ in range(4)]
    assert [r.status_code for r in more] == [200] * 3 + [429]  # a's 3, then the store's none
    assert counters(tmp_path) == {GLOBAL_KEY: 10}


async def test_a_closing_pool_returns_the_units_its_hosts_hold(
    pool: KeyPool, tmp_path: Path
) -> None:
    a = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    b = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    async with client(a) as ca, client(b) as cb:
        assert (await ca.get("/")).status_code == 200
        assert (await cb.get("/")).status_code == 200
        assert (await cb.get("/")).status_code == 200
    assert counters(tmp_path) == {GLOBAL_KEY: 8}
    await pool.close()
    # 3 served: the 5 units a and b held were refunded to their window.
    assert counters(tmp_path) == {GLOBAL_KEY: 3}


async def test_a_window_that_ends_drops_what_is_held_and_the_next_is_leased_anew(
    pool: KeyPool, tmp_path: Path, clock: ManualClock
) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 4))
    async with client(app) as c:
        assert (await c.get("/")).status_code == 200
        clock.advance(60)
        second = await c.get("/")
    assert second.status_code == 200
    assert second.headers["ratelimit"] == '"g";r=9;t=60'
    # The new window's lease; the 3 units held of the old one are not carried over.
    assert counters(tmp_path) == {GLOBAL_KEY: 4}
    await pool.close()
    assert counters(tmp_path) == {GLOBAL_KEY: 1}


async def test_another_limit_refusing_gives_the_units_back(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 5, Limit(1, 60, name="c")))
    async with client(app) as c:
        first = await c.get("/")
        second = await c.get("/")  # the client's limit refuses: the global unit returns
    assert (first.status_code, second.status_code) == (200, 429)
    assert second.json()["level"] == "client"
    assert second.headers["ratelimit"] == '"c";r=0;t=60, "g";r=9;t=60'
    await pool.close()
    assert counters(tmp_path) == {GLOBAL_KEY: 1, f"rl{US}default{US}c{US}10.1.1.1": 1}


async def test_a_refusal_by_the_slice_asks_nothing_else_of_the_store(
    pool: KeyPool, tmp_path: Path
) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(2, 2, Limit(100, 60, name="c")))
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 429, 429]
    # Told as the limit that refused; the client's limit was not charged for it.
    assert responses[2].headers["ratelimit"] == '"g";r=0;t=60'
    assert counters(tmp_path) == {GLOBAL_KEY: 2, f"rl{US}default{US}c{US}10.1.1.1": 2}


async def test_a_cost_above_the_slice_leases_the_cost(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(10, 2, cost=7))
    async with client(app) as c:
        responses = [await c.get("/") for _ in range(2)]
    assert [r.status_code for r in responses] == [200, 429]  # 7, then 3 left < 7
    assert counters(tmp_path) == {GLOBAL_KEY: 7}


async def test_concurrent_requests_share_one_lease(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(ok, pool=pool, rules=sliced(100, 20))
    async with client(app) as c:
        responses = await asyncio.gather(*(c.get("/") for _ in range(30)))
    assert all(r.status_code == 200 for r in responses)
    assert counters(tmp_path) == {GLOBAL_KEY: 40}  # two leases, not one per request


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Limit(5, 60, slice=6), "slice must be an integer from 1 to its amount"),
        (lambda: Limit(5, 60, slice=0), "slice must be an integer from 1 to its amount"),
        (lambda: Limit(5, 60, slice=True), "slice must be an integer from 1 to its amount"),
        (lambda: Limit("5/minute sliding", slice=2), "fixed-window limits only"),
        (lambda: Rule(Limit(5, 60, slice=2), settle=True), "settle=True cannot take"),
        (
            lambda: Rule([Limit(5, 60, slice=2), Concurrency(2)]),
            "a Concurrency cap cannot take",
        ),
        (
            lambda: Rule(
                Limit(5, 60, slice=2), plans=Plans({"pro": "50/minute"}, plan=lambda s: None)
            ),
            "plans cannot take",
        ),
        (
            lambda: Plans({"pro": [Limit(5, 60, slice=2)]}, plan=lambda s: None),
            "has a slice; a sliced limit goes on the rule",
        ),
        (lambda: DemoConfig(global_slice=5), "--global-slice takes 1 to --global-limit"),
        (
            lambda: DemoConfig(global_limit=10, global_slice=5, max_in_flight=2),
            "without --plans or --max-in-flight",
        ),
    ],
)
def test_a_slice_the_store_would_have_to_decide_with_the_rest_is_refused(
    make: object, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        make()  # type: ignore[operator]


async def test_a_lease_whose_request_is_cancelled_still_brings_its_units(
    clock: ManualClock,
) -> None:
    # The store charges a lease it decides whatever happens to the request that sent
    # it: the units must reach the slice, for the next request, not vanish with it.
    book = SliceBook(clock)
    gate = asyncio.Event()
    leases: list[int] = []

    async def lease(key: str, amount: int, window: float, units: int) -> Hit:
        leases.append(units)
        await gate.wait()
        hit = Hit([key], [amount], [window], cost=units)
        hit.allowed, hit.fits, hit.remaining = True, [True], [amount - units]
        hit.next = hit.full = hit.retry = [window]
        hit.stamp, hit.wall = [clock.monotonic()], clock.wall()
        return hit

    first = asyncio.ensure_future(book.take("g", 10, 60.0, 4, 1, lease))
    await until(lambda: leases, "the lease sent")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    taken = await book.take("g", 10, 60.0, 4, 1, lease)
    assert isinstance(taken, tuple)
    assert (taken[1], taken[0].units, leases) == (True, 3, [4])  # no second lease
    assert [refund.deltas for refund in book.drain()] == [[-3]]
