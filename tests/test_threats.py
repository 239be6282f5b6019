"""The security review's findings (issue 12, THREATS.md), in process: each test fails on the
code before its fix."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from porch import (
    CallerScope,
    ClientIdentity,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    ManualClock,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch._types import ASGIApp, Message, Receive, Scope, Send

pytestmark = pytest.mark.anyio


class Orders:
    """An app that counts executions and can put any header in its response."""

    def __init__(self) -> None:
        self.calls = 0
        self.extra: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        while (await receive()).get("more_body", False):
            pass
        headers = [(b"content-type", b"text/plain"), *self.extra]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": f"order {self.calls}".encode()})


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path, clock=ManualClock()), size=2)
    yield p
    await p.close()


def client(app: ASGIApp, peer: str = "10.1.1.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://t")


def keyed(key: str = "order-1", **extra: str) -> dict[str, str]:
    return {"idempotency-key": key, **extra}


# --- finding 1: the default scope -----------------------------------------------------------


async def test_anonymous_clients_never_share_a_key(pool: KeyPool) -> None:
    orders = Orders()
    app = IdempotencyMiddleware(orders, pool=pool)
    async with client(app, "10.0.0.1") as alice, client(app, "10.0.0.2") as bob:
        first = await alice.post("/orders", content=b"tea", headers=keyed())
        same = await bob.post("/orders", content=b"tea", headers=keyed())
        other = await bob.post("/orders", content=b"lamp", headers=keyed("order-2"))
        probe = await bob.post("/orders", content=b"chair", headers=keyed())
        replay = await alice.post("/orders", content=b"tea", headers=keyed())
    # Bob neither gets alice's order (replay) nor learns that her key exists (422).
    assert "idempotent-replayed" not in same.headers
    assert same.content != first.content
    assert other.status_code == 201
    assert probe.status_code == 422  # bob's own "order-1" was for "tea"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content


async def test_cookie_sessions_and_x_api_key_apps_do_not_share_a_key(pool: KeyPool) -> None:
    orders = Orders()
    app = IdempotencyMiddleware(orders, pool=pool)
    async with client(app, "10.0.0.9") as c:  # one address: a NAT, or the same proxy
        a = await c.post("/orders", content=b"x", headers=keyed(cookie="session=a"))
        b = await c.post("/orders", content=b"y", headers=keyed(cookie="session=b"))
        auth = await c.post("/orders", content=b"x", headers=keyed(authorization="session=a"))
        again = await c.post("/orders", content=b"x", headers=keyed(cookie="session=a"))
    assert [a.status_code, b.status_code, auth.status_code] == [201, 201, 201]
    assert "idempotent-replayed" not in auth.headers  # Cookie: x is not Authorization: x
    assert again.headers["idempotent-replayed"] == "true"
    assert orders.calls == 3


def test_caller_scope_uses_the_limiters_identity() -> None:
    behind_proxy = CallerScope(identity=ClientIdentity(trust_hops=1))
    scope: Scope = {
        "type": "http",
        "client": ("10.0.0.1", 1),
        "headers": [(b"x-forwarded-for", b"203.0.113.7")],
    }
    assert behind_proxy(scope) == "client:203.0.113.7"
    assert CallerScope()(scope) == "client:10.0.0.1"


# --- finding 6: methods ---------------------------------------------------------------------


async def test_head_counts_as_get_for_a_methods_rule(pool: KeyPool) -> None:
    orders = Orders()
    app = RateLimitMiddleware(orders, pool=pool, rules=Rule(Limit(2, 60), methods=["GET"]))
    async with client(app) as c:
        codes = [(await c.request(m, "/products")).status_code for m in ("GET", "HEAD", "HEAD")]
    assert codes == [201, 201, 429]
    assert orders.calls == 2


async def call(app: ASGIApp, method: str, key: str) -> tuple[int, dict[bytes, bytes]]:
    """One request with the method exactly as given (httpx would upper-case it; h11 does not)."""
    scope: Scope = {
        "type": "http",
        "method": method,
        "path": "/orders",
        "query_string": b"",
        "headers": [(b"idempotency-key", key.encode())],
        "client": ("10.1.1.1", 40000),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"x", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"])


async def test_lower_case_methods_do_not_skip_rules(pool: KeyPool) -> None:
    orders = Orders()
    limited = RateLimitMiddleware(orders, pool=pool, rules=Rule(Limit(1, 60), methods=["POST"]))
    app = IdempotencyMiddleware(limited, pool=pool, rules=IdempotencyRule("/orders"))
    first = await call(app, "post", "order-1")
    again = await call(app, "post", "order-1")
    other = await call(app, "post", "order-2")
    assert first[0] == 201
    assert again[1][b"idempotent-replayed"] == b"true"  # idempotency saw "post"
    assert other[0] == 429  # and so did the limiter
    assert orders.calls == 1


# --- finding 7: the digest ------------------------------------------------------------------


async def test_content_type_and_named_headers_are_in_the_digest(pool: KeyPool) -> None:
    orders = Orders()
    rule = IdempotencyRule("/orders", methods=["POST"], digest_headers=["X-Account"])
    app = IdempotencyMiddleware(orders, pool=pool, rules=rule, scope=lambda s: "one-user")
    async with client(app) as c:
        base = {"content-type": "application/json", "x-account": "a"}
        first = await c.post("/orders", content=b"{}", headers=keyed(**base))
        form = await c.post(
            "/orders", content=b"{}", headers=keyed(**{**base, "content-type": "text/plain"})
        )
        other = {**base, "x-account": "b"}
        account = await c.post("/orders", content=b"{}", headers=keyed(**other))
        bare = await c.post("/orders", content=b"{}", headers=keyed())
        same = await c.post("/orders", content=b"{}", headers=keyed(**base))
    assert first.status_code == 201
    assert [form.status_code, account.status_code, bare.status_code] == [422, 422, 422]
    assert same.headers["idempotent-replayed"] == "true"
    assert orders.calls == 1


# --- finding 9: header bytes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        (b"location", b"/orders/1\r\nset-cookie: x=1"),
        (b"location", b"/orders/\x00"),
        (b"x-bad name", b"1"),
        (b"x-bad\nname", b"1"),
        (b"x-bad,name", b"1"),
        (b"", b"1"),
        (b"x-ok", b"tab\tfine but\x7f"),
    ],
)
async def test_a_response_with_unsendable_header_bytes_is_not_stored(
    pool: KeyPool, header: tuple[bytes, bytes]
) -> None:
    orders = Orders()
    orders.extra = [header]
    app = IdempotencyMiddleware(orders, pool=pool)
    async with client(app) as c:
        for _ in range(2):
            r = await c.post("/orders", content=b"x", headers=keyed())
            assert "idempotent-replayed" not in r.headers
    # Not stored, key released: the retry runs the handler again instead of failing for 24 h.
    assert orders.calls == 2


async def test_concurrent_anonymous_clients_with_one_key_each_run(pool: KeyPool) -> None:
    orders = Orders()
    app = IdempotencyMiddleware(orders, pool=pool)
    clients = [client(app, f"10.0.1.{i}") for i in range(5)]
    try:
        responses = await asyncio.gather(
            *(c.post("/orders", content=b"x", headers=keyed()) for c in clients)
        )
    finally:
        for c in clients:
            await c.aclose()
    assert all("idempotent-replayed" not in r.headers for r in responses)
    assert orders.calls == 5


# --- finding 4: forwarding headers padded by a client ---------------------------------------


@pytest.mark.parametrize(
    ("header", "mine", "padding"),
    [
        ("x-forwarded-for", "203.0.113.7", ["1.1.1.1, " * 600, "junk," * 40, "x" * 5000]),
        (
            "forwarded",
            "for=203.0.113.7",
            ["for=1.1.1.1, " * 400, 'for="unbalanced, ' * 10, "secure, " * 40],
        ),
    ],
)
async def test_padding_forwarding_headers_at_429_changes_nothing(
    pool: KeyPool, header: str, mine: str, padding: list[str]
) -> None:
    orders = Orders()
    identity = ClientIdentity(trust_hops=1, header=header)  # type: ignore[arg-type]
    app = RateLimitMiddleware(orders, pool=pool, rules=Rule(Limit(2, 60)), key=identity)
    async with client(app, "10.0.0.1") as via_proxy:  # every client arrives from the proxy
        for _ in range(2):
            assert (await via_proxy.get("/", headers={header: mine})).status_code == 201
        for junk in padding:
            # The proxy appends what it saw to whatever the client sent.
            padded = await via_proxy.get("/", headers={header: f"{junk}, {mine}"})
            assert padded.status_code == 429, junk[:40]
        # Nothing was counted under the proxy's own key: an honest client is served.
        honest = await via_proxy.get("/", headers={header: mine.replace("203.0.113.7", "10.9.9.9")})
        assert honest.status_code == 201
        assert (await via_proxy.get("/")).status_code == 201  # the proxy's key itself
    assert orders.calls == 4


async def test_an_unreadable_trusted_entry_is_a_400_problem(pool: KeyPool) -> None:
    orders = Orders()
    app = RateLimitMiddleware(
        orders, pool=pool, rules=Rule(Limit(2, 60)), key=ClientIdentity(trust_hops=1)
    )
    async with client(app) as c:
        r = await c.get("/", headers={"x-forwarded-for": "1.2.3.4, not-an-address"})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["cause"] == "forwarding"
    assert "hop 1 from the right of the x-forwarded-for header" in r.json()["detail"]
    assert orders.calls == 0


# --- finding 5: IPv6 ------------------------------------------------------------------------


async def test_a_host_rotating_addresses_in_its_64_is_limited(pool: KeyPool) -> None:
    orders = Orders()
    app = RateLimitMiddleware(orders, pool=pool, rules=Rule(Limit(2, 60)))
    codes = []
    for i in range(10):
        async with client(app, f"2001:db8:1:2::{i + 1:x}") as c:
            codes.append((await c.get("/")).status_code)
    assert codes == [201, 201] + [429] * 8
    async with client(app, "64:ff9b::c000:221") as nat64, client(app, "64:ff9b::c000:222") as other:
        # Two IPv4 hosts behind one NAT64 gateway share a /64 but are two clients.
        assert [(await nat64.get("/")).status_code for _ in range(2)] == [201, 201]
        assert (await other.get("/")).status_code == 201


# --- finding 2: fair refusals ---------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=500.0, wall=1_700_000_000.0)


@pytest.fixture
async def small_pool(tmp_path: Path, clock: ManualClock) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path, clock=clock), size=1, mailbox=4)
    yield p
    await p.close()


async def test_a_known_refusal_is_answered_without_a_mailbox_slot(
    small_pool: KeyPool, clock: ManualClock
) -> None:
    orders = Orders()
    app = RateLimitMiddleware(orders, pool=small_pool, rules=Rule(Limit(2, 60, name="api")))
    async with client(app, "10.0.0.1") as flooder, client(app, "10.0.0.2") as other:
        for _ in range(2):
            assert (await flooder.get("/")).status_code == 201
        first = await flooder.get("/")
        assert first.status_code == 429
        calls = small_pool.statistics().calls
        clock.advance(0.5)
        # 40 at once against a mailbox of 4: none of them queues, so none is a 503.
        flood = await asyncio.gather(*(flooder.get("/") for _ in range(40)))
        assert small_pool.statistics().calls == calls
        assert {r.status_code for r in flood} == {429}
        assert (await other.get("/")).status_code == 201
    assert small_pool.statistics().saturations == 0
    # The remembered refusal says what the store would say now.
    r = flood[0]
    assert r.headers["retry-after"] == "60"  # ceil(59.5)
    assert r.headers["ratelimit"] == '"api";r=0;t=60'
    assert r.headers["x-ratelimit-remaining"] == "0"
    assert int(r.headers["x-ratelimit-reset"]) == int(first.headers["x-ratelimit-reset"])
    assert r.json()["violated"][0]["policy"] == "api"
    assert orders.calls == 3


async def test_a_remembered_refusal_is_asked_again_after_refusal_memory(
    small_pool: KeyPool, clock: ManualClock, tmp_path: Path
) -> None:
    orders = Orders()
    app = RateLimitMiddleware(orders, pool=small_pool, rules=Rule(Limit(1, 60)), refusal_memory=2.0)
    async with client(app) as c:
        assert (await c.get("/")).status_code == 201
        assert (await c.get("/")).status_code == 429
        calls = small_pool.statistics().calls
        clock.advance(2.0)
        # Expired while still over the limit: of 20 at once, one asks the store and the
        # others wait for its answer instead of taking a mailbox slot each.
        burst = await asyncio.gather(*(c.get("/") for _ in range(20)))
        assert {r.status_code for r in burst} == {429}
        assert small_pool.statistics().calls == calls + 1
        # An operator resets the counter (porch reset): the memory outlives it by at
        # most refusal_memory seconds.
        with sqlite3.connect(tmp_path / "porch.sqlite3") as db:
            db.execute("DELETE FROM counters")
        clock.advance(1.9)
        assert (await c.get("/")).status_code == 429
        clock.advance(0.1)
        assert (await c.get("/")).status_code == 201
    assert small_pool.statistics().saturations == 0
    assert orders.calls == 2


async def test_a_refusal_is_not_remembered_past_its_window(
    small_pool: KeyPool, clock: ManualClock
) -> None:
    orders = Orders()
    app = RateLimitMiddleware(orders, pool=small_pool, rules=Rule(Limit(1, 2)), refusal_memory=30.0)
    async with client(app) as c:
        assert (await c.get("/")).status_code == 201
        assert (await c.get("/")).status_code == 429
        clock.advance(2)
        assert (await c.get("/")).status_code == 201


async def test_the_refusal_memory_is_bounded(small_pool: KeyPool) -> None:
    app = RateLimitMiddleware(
        Orders(), pool=small_pool, rules=Rule(Limit(1, 60)), refusal_memory_entries=3
    )
    for i in range(10):
        async with client(app, f"10.0.2.{i}") as c:
            await c.get("/")
            assert (await c.get("/")).status_code == 429
    assert app._memory is not None
    assert len(app._memory) == 3
