from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    ManualClock,
    SQLiteStore,
)
from porch._types import ASGIApp, Message, Receive, Scope, Send
from porch.store.base import Quota, Save, StoreOp
from porch.store.sqlite.claims import ofd_locks_available
from support import spin, through_apply, until

pytestmark = pytest.mark.anyio


class Handler:
    """An app that counts executions and answers what it is told to."""

    def __init__(self) -> None:
        self.calls = 0
        self.status = 201
        self.latency = 0.0
        self.body_size = 0
        self.fail_first = 0
        self.raises = False
        self.bodies: list[bytes] = []
        # Set: each call waits for it before answering (an owner a test holds inside its handler).
        self.gate: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        message = await receive()
        self.bodies.append(message.get("body", b""))
        if self.gate is not None:
            await self.gate.wait()
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.raises:
            raise RuntimeError("handler exploded")
        status = 500 if self.calls <= self.fail_first else self.status
        body = b"x" * self.body_size if self.body_size else f"call {self.calls}".encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"text/plain"),
                    (b"location", f"/orders/{self.calls}".encode()),
                    (b"set-cookie", b"session=secret"),
                    (b"date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
                    (b"x-internal", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body[:3], "more_body": True})
        await send({"type": "http.response.body", "body": body[3:]})


@pytest.fixture
def handler() -> Handler:
    return Handler()


Make = Callable[..., httpx.AsyncClient]


@pytest.fixture
def make(pool: KeyPool, handler: Handler) -> Make:
    def build(**kwargs: Any) -> httpx.AsyncClient:
        app: ASGIApp = IdempotencyMiddleware(handler, pool=pool, **kwargs)
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", cookies=no_cookies()
        )

    return build


def no_cookies() -> http.cookiejar.CookieJar:
    """A jar that keeps nothing: the handler sets a cookie, and a client sending it back
    would be another caller (CallerScope), not a retry."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def keyed(key: str = "k1", **extra: str) -> dict[str, str]:
    return {"idempotency-key": key, **extra}


def keyed_scope() -> Scope:
    """The scope of a keyed POST, for tests that drive the middleware without a client."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/o",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k")],
        "client": ("10.1.2.3", 5000),
    }


async def test_replay_is_byte_identical_with_allowed_headers_only(
    make: Make, handler: Handler
) -> None:
    async with make() as c:
        first = await c.post("/orders", content=b'{"a":1}', headers=keyed())
        again = [await c.post("/orders", content=b'{"a":1}', headers=keyed()) for _ in range(3)]
    assert handler.calls == 1
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers["set-cookie"] == "session=secret"
    for r in again:
        assert r.status_code == 201
        assert r.content == first.content == b"call 1"
        assert r.headers["idempotent-replayed"] == "true"
        assert r.headers["content-type"] == "text/plain"
        assert r.headers["location"] == "/orders/1"
        for never in ("set-cookie", "date", "x-internal"):
            assert never not in r.headers


async def test_same_key_different_request_is_422_and_does_not_run(
    make: Make, handler: Handler
) -> None:
    async with make() as c:
        await c.post("/orders", content=b"one", headers=keyed())
        for method, url, body in [
            ("POST", "/orders", b"two"),
            ("POST", "/orders?x=1", b"one"),
            ("PATCH", "/orders", b"one"),
        ]:
            r = await c.request(method, url, content=body, headers=keyed())
            assert r.status_code == 422, (method, url)
            assert r.headers["content-type"] == "application/problem+json"
    assert handler.calls == 1


async def test_concurrent_duplicates_run_once(make: Make, handler: Handler) -> None:
    handler.latency = 0.2
    async with make() as c:
        responses = await asyncio.gather(
            *(c.post("/orders", content=b"same", headers=keyed()) for _ in range(10))
        )
    assert handler.calls == 1
    assert {r.content for r in responses} == {b"call 1"}
    assert sum("idempotent-replayed" not in r.headers for r in responses) == 1


async def test_waiter_past_its_deadline_gets_409(make: Make, handler: Handler) -> None:
    handler.gate = asyncio.Event()
    async with make(wait_timeout=0.1) as c:
        owner = asyncio.create_task(c.post("/orders", content=b"b", headers=keyed()))
        await until(lambda: handler.calls == 1, "the owner runs the handler")
        waiter = await c.post("/orders", content=b"b", headers=keyed())
        assert waiter.status_code == 409
        assert waiter.headers["retry-after"] == "1"
        assert not owner.done()
        handler.gate.set()
        assert (await owner).status_code == 201
        late = await c.post("/orders", content=b"b", headers=keyed())
    assert late.headers["idempotent-replayed"] == "true"
    assert handler.calls == 1


@pytest.mark.parametrize("status", [500, 503, 408, 409, 425, 429])
async def test_unstored_statuses_run_again(make: Make, handler: Handler, status: int) -> None:
    handler.status = status
    async with make() as c:
        for _ in range(2):
            r = await c.post("/orders", content=b"b", headers=keyed())
            assert r.status_code == status
            assert "idempotent-replayed" not in r.headers
    assert handler.calls == 2


@pytest.mark.parametrize("status", [200, 201, 204, 400, 404, 422])
async def test_stored_statuses_replay(make: Make, handler: Handler, status: int) -> None:
    handler.status = status
    async with make() as c:
        for _ in range(2):
            assert (await c.post("/orders", content=b"b", headers=keyed())).status_code == status
    assert handler.calls == 1


async def test_failed_owner_hands_ownership_to_the_next_waiter(
    make: Make, handler: Handler
) -> None:
    handler.latency = 0.2
    handler.fail_first = 1
    async with make() as c:
        responses = await asyncio.gather(
            *(c.post("/orders", content=b"b", headers=keyed()) for _ in range(4))
        )
    codes = sorted(r.status_code for r in responses)
    assert codes == [201, 201, 201, 500]
    assert handler.calls == 2
    assert {r.content for r in responses if r.status_code == 201} == {b"call 2"}


async def test_raising_owner_stores_nothing_and_releases(make: Make, handler: Handler) -> None:
    handler.raises = True
    async with make() as c:
        with pytest.raises(RuntimeError, match="exploded"):
            await c.post("/orders", content=b"b", headers=keyed())
        handler.raises = False
        r = await c.post("/orders", content=b"b", headers=keyed())
    assert r.status_code == 201
    assert handler.calls == 2


async def test_keys_are_scoped_to_the_caller(make: Make, handler: Handler) -> None:
    async with make() as c:
        alice = await c.post("/o", content=b"b", headers=keyed(authorization="Bearer alice"))
        bob = await c.post("/o", content=b"b", headers=keyed(authorization="Bearer bob"))
        anon = await c.post("/o", content=b"b", headers=keyed())
        alice2 = await c.post("/o", content=b"b", headers=keyed(authorization="Bearer alice"))
    assert handler.calls == 3
    assert [alice.content, bob.content, anon.content] == [b"call 1", b"call 2", b"call 3"]
    assert alice2.content == b"call 1"


async def test_custom_scope_function(make: Make, handler: Handler) -> None:
    def tenant(scope: Scope) -> str:
        headers: dict[bytes, bytes] = dict(scope["headers"])
        return headers.get(b"x-tenant", b"none").decode()

    async with make(scope=tenant) as c:
        await c.post("/o", content=b"b", headers=keyed(**{"x-tenant": "t1"}))
        await c.post("/o", content=b"b", headers=keyed(**{"x-tenant": "t2"}))
        await c.post("/o", content=b"b", headers=keyed(**{"x-tenant": "t1"}))
    assert handler.calls == 2


async def test_body_cap_is_413_and_runs_nothing(make: Make, handler: Handler) -> None:
    async with make(max_body=10) as c:
        r = await c.post("/o", content=b"x" * 11, headers=keyed())
        ok = await c.post("/o", content=b"x" * 10, headers=keyed("k2"))
        unkeyed = await c.post("/o", content=b"x" * 100)
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert ok.status_code == 201
    assert unkeyed.status_code == 201  # the cap is for keyed requests only
    assert handler.calls == 2


async def test_oversized_response_is_sent_but_not_stored(
    make: Make, handler: Handler, caplog: pytest.LogCaptureFixture
) -> None:
    handler.body_size = 100
    async with make(max_stored=50) as c:
        first = await c.post("/o", content=b"b", headers=keyed())
        second = await c.post("/o", content=b"b", headers=keyed())
    assert first.content == second.content == b"x" * 100
    assert "idempotent-replayed" not in second.headers
    assert handler.calls == 2
    assert "not stored" in caplog.text


async def test_invalid_and_required_keys(make: Make, handler: Handler) -> None:
    rules = [IdempotencyRule("/pay", methods=["POST"], required=True), IdempotencyRule("/o")]
    async with make(rules=rules) as c:
        missing = await c.post("/pay", content=b"b")
        empty = await c.post("/o", content=b"b", headers={"idempotency-key": ""})
        long = await c.post("/o", content=b"b", headers={"idempotency-key": "x" * 256})
        two = await c.post(
            "/o", content=b"b", headers=[("idempotency-key", "a"), ("idempotency-key", "b")]
        )
        unkeyed = await c.post("/o", content=b"b")
        get = await c.get("/o", headers={"idempotency-key": "x" * 300})
    for r in (missing, empty, long, two):
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/problem+json"
    assert "requires an Idempotency-Key" in missing.json()["detail"]
    assert unkeyed.status_code == 201
    assert get.status_code == 201  # GET is not selected: passes untouched
    assert handler.calls == 2


@pytest.mark.parametrize("completes", [False, True])
async def test_stored_if_and_only_if_the_app_completes_its_response(
    pool: KeyPool, completes: bool
) -> None:
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        calls += 1
        await receive()
        gone = await receive()  # the client left mid-handler
        assert gone["type"] == "http.disconnect"
        await send({"type": "http.response.start", "status": 201, "headers": []})
        # An app that gives up sends no final chunk; one that finishes its work does.
        await send({"type": "http.response.body", "body": b"done", "more_body": not completes})

    mw = IdempotencyMiddleware(app, pool=pool)
    scope = keyed_scope()

    async def run() -> list[Message]:
        inbox: list[Message] = [
            {"type": "http.request", "body": b"b", "more_body": False},
            {"type": "http.disconnect"},
        ]
        sent: list[Message] = []

        async def receive() -> Message:
            return inbox.pop(0) if inbox else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        await mw(scope, receive, send)
        return sent

    await run()
    second = await run()
    assert calls == (1 if completes else 2)
    if completes:
        assert dict(second[0]["headers"])[b"idempotent-replayed"] == b"true"


class SlowSaveStore(SQLiteStore):
    """Holds every transaction that stores a response until ``gate`` is set."""

    gate: asyncio.Event
    held = False  # a Save reached the gate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        through_apply(self)

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        if any(isinstance(op, Save) for op in ops):
            self.held = True
            await self.gate.wait()
        await super().apply(ops)


def keyed_post(app: ASGIApp) -> tuple[asyncio.Future[None], list[Message]]:
    """Start one keyed POST straight into ``app``; the task, and every message it sends."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"b", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    return asyncio.ensure_future(app(keyed_scope(), receive, send)), sent


async def test_last_chunk_leaves_only_after_the_commit(tmp_path: Path) -> None:
    store = SlowSaveStore(tmp_path)
    store.gate = asyncio.Event()
    handler = Handler()
    async with KeyPool(store, size=1) as pool:
        task, sent = keyed_post(IdempotencyMiddleware(handler, pool=pool))
        await until(lambda: store.held, "the response's Save reached the store")
        await spin()
        # Start and the first chunk are out; the final chunk waits for the commit.
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert [m.get("more_body", False) for m in sent[1:]] == [True]
        store.gate.set()
        await task
        assert [m.get("more_body", False) for m in sent[1:]] == [True, False]


async def test_a_one_chunk_response_leaves_whole_after_the_commit(tmp_path: Path) -> None:
    # The head is held with the body: nothing of the response leaves before its
    # stored copy is committed, and then head and body leave together.
    store = SlowSaveStore(tmp_path)
    store.gate = asyncio.Event()

    async def one_chunk(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"created"})

    async with KeyPool(store, size=1) as pool:
        task, sent = keyed_post(IdempotencyMiddleware(one_chunk, pool=pool))
        await until(lambda: store.held, "the response's Save reached the store")
        await spin()
        assert sent == []
        store.gate.set()
        await task
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[1]["body"] == b"created"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rules": []}, "needs at least one IdempotencyRule"),
        ({"ttl": 0}, "ttl must be > 0"),
        ({"wait_timeout": 0}, "wait_timeout must be > 0"),
        ({"max_body": -1}, "max_body must be >= 0"),
        ({"max_stored": -1}, "max_stored must be >= 0"),
        ({"retry_after": 0}, "retry_after must be >= 1"),
    ],
)
def test_configuration_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(Handler(), pool=KeyPool(SQLiteStore(tmp_path)), **kwargs)


def test_rule_validation() -> None:
    with pytest.raises(ConfigurationError, match="must start with '/'"):
        IdempotencyRule("orders")
    with pytest.raises(ConfigurationError, match="at least one method"):
        IdempotencyRule("/", methods=[])


@contextlib.asynccontextmanager
async def two_pools(tmp_path: Path, handler: Handler) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Two pools on one store, each behind its own middleware: two workers, in one process."""
    pools = [KeyPool(SQLiteStore(tmp_path), size=2) for _ in range(2)]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(handler, pool=p)),
            base_url="http://t",
            cookies=no_cookies(),
        )
        for p in pools
    ]
    try:
        yield clients
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_two_pools_on_one_store_run_a_key_once(tmp_path: Path) -> None:
    # Two pools on one data directory behave like two worker processes: the
    # store's key locks exclude owners across them, and the waiter in the other
    # pool gets the stored response once the lock is free.
    handler = Handler()
    handler.latency = 0.3
    async with two_pools(tmp_path, handler) as clients:
        responses = await asyncio.gather(
            *(clients[i % 2].post("/o", content=b"b", headers=keyed()) for i in range(6))
        )
    assert handler.calls == 1
    assert {r.content for r in responses} == {b"call 1"}
    assert {r.status_code for r in responses} == {201}


class WatchedClaims:
    """A store's real claims, noting when a caller parks on another holder's claim."""

    def __init__(self, claims: Any) -> None:
        self.claims = claims
        self.watching = asyncio.Event()

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        cancel: Callable[[], None] = self.claims.watch(key, wake, retry_after)
        self.watching.set()
        return cancel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.claims, name)


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_a_failed_owner_in_one_pool_hands_over_to_the_other(tmp_path: Path) -> None:
    # The order is driven, not slept on: the first pool's owner is held inside the
    # handler (so it holds the key's claim) until the second pool's caller is seen
    # parked on that claim; only then does the owner fail and hand over.
    owner_runs, gate = asyncio.Event(), asyncio.Event()
    inner = Handler()
    inner.fail_first = 1

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        if not owner_runs.is_set():  # the first owner: it holds the claim while held here
            owner_runs.set()
            await gate.wait()
        await inner(scope, receive, send)

    pools = [KeyPool(SQLiteStore(tmp_path), size=2) for _ in range(2)]
    watched = WatchedClaims(pools[1].store.claims)
    pools[1].store.claims = watched
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(handler, pool=p)),
            base_url="http://t",
            cookies=no_cookies(),
        )
        for p in pools
    ]
    try:
        first = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await asyncio.wait_for(owner_runs.wait(), 30)  # pool 0 holds the key's claim
        second = asyncio.create_task(clients[1].post("/o", content=b"b", headers=keyed()))
        await asyncio.wait_for(watched.watching.wait(), 30)
        assert not first.done()
        assert not second.done()
        gate.set()
        assert (await first).status_code == 500
        assert (await second).status_code == 201
        assert inner.calls == 2
        replay = await clients[0].post("/o", content=b"b", headers=keyed())
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.content == (await second).content
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


async def test_stored_responses_expire_after_their_ttl(tmp_path: Path) -> None:
    clock = ManualClock()
    handler = Handler()
    async with KeyPool(SQLiteStore(tmp_path, clock=clock)) as pool:
        app = IdempotencyMiddleware(handler, pool=pool, ttl=60)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", cookies=no_cookies()
        ) as c:
            await c.post("/o", content=b"b", headers=keyed())
            clock.advance(59)
            assert (await c.post("/o", content=b"b", headers=keyed())).headers[
                "idempotent-replayed"
            ] == "true"
            clock.advance(1)
            again = await c.post("/o", content=b"b", headers=keyed())
    assert "idempotent-replayed" not in again.headers  # expired: the handler ran again
    assert handler.calls == 2


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_waiting_for_another_pools_lock_ends_at_the_deadline(tmp_path: Path) -> None:
    # The second pool's caller waits for the first pool's key lock (another
    # process, in production): its wait_timeout deadline holds there too.
    handler = Handler()
    handler.gate = asyncio.Event()
    pools = [KeyPool(SQLiteStore(tmp_path), size=2) for _ in range(2)]
    apps = [
        IdempotencyMiddleware(handler, pool=pools[0]),
        IdempotencyMiddleware(handler, pool=pools[1], wait_timeout=0.1),
    ]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", cookies=no_cookies()
        )
        for app in apps
    ]
    try:
        owner = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await until(lambda: handler.calls == 1, "the first pool's owner runs the handler")
        waiter = await clients[1].post("/o", content=b"b", headers=keyed())
        assert waiter.status_code == 409
        assert not owner.done()  # the deadline ended the wait, not the owner
        handler.gate.set()
        assert (await owner).status_code == 201
        replay = await clients[1].post("/o", content=b"b", headers=keyed())
        assert replay.headers["idempotent-replayed"] == "true"
        assert handler.calls == 1
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


def parked_waiters(pool: KeyPool) -> list[int]:
    """How many callers each in-flight key of the pool keeps in its waiter list."""
    return [
        len(state.waiters)  # type: ignore[attr-defined]
        for shard in pool._shards
        for state in shard.parked.values()
    ]


async def test_a_waiter_past_its_deadline_leaves_the_waiter_list_at_once(
    pool: KeyPool, make: Make, handler: Handler
) -> None:
    handler.gate = asyncio.Event()
    async with make(wait_timeout=0.1) as c:
        owner = asyncio.create_task(c.post("/orders", content=b"b", headers=keyed()))
        await until(lambda: handler.calls == 1, "the owner runs the handler")
        waiters = await asyncio.gather(
            *(c.post("/orders", content=b"b", headers=keyed()) for _ in range(5))
        )
        assert {w.status_code for w in waiters} == {409}
        # The owner still runs: its key is in flight, and nobody is left waiting on it.
        assert not owner.done()
        assert parked_waiters(pool) == [0]
        handler.gate.set()
        assert (await owner).status_code == 201
    assert parked_waiters(pool) == []


async def test_over_quota_a_keyed_request_is_refused_before_it_runs(
    make: Make, handler: Handler, caplog: pytest.LogCaptureFixture
) -> None:
    # Each claim reserves max_stored (1200) bytes; a stored response is about 1.1 kB.
    handler.body_size = 1000
    quota = Quota(scope_bytes=2500, total_bytes=1 << 20, client_bytes=1 << 20)
    async with make(quota=quota, max_stored=1200) as c:

        async def post(key: str, caller: str) -> httpx.Response:
            return await c.post("/o", content=b"b", headers=keyed(key, authorization=caller))

        first = [await post(f"k{i}", "Bearer alice") for i in range(4)]
        again = [await post(f"k{i}", "Bearer alice") for i in range(4)]
        bob = await post("k3", "Bearer bob")
        bob2 = await post("k3", "Bearer bob")
    # Two fit alice's quota (1100 stored + 1200 reserved <= 2500); the others never ran.
    assert [r.status_code for r in first] == [201, 201, 429, 429]
    assert [r.status_code for r in again] == [201, 201, 429, 429]
    assert ["idempotent-replayed" in r.headers for r in again] == [True, True, False, False]
    refused = first[2]
    assert refused.json()["cause"] == "quota"
    assert int(refused.headers["retry-after"]) >= 1
    assert handler.calls == 2 + 1  # alice's two, bob's one: no retry ran a handler twice
    # Another caller has a quota of its own.
    assert bob2.headers["idempotent-replayed"] == "true"
    assert bob2.content == bob.content
    warnings = [r for r in caplog.records if "quota" in r.getMessage()]
    assert len(warnings) == 1  # four refusals, one warning: throttled per scope


async def test_new_credentials_buy_no_new_room_and_a_full_store_is_503(
    make: Make, handler: Handler, pool: KeyPool
) -> None:
    # Catches: each new Cookie was a new scope with its own quota (issue 26, finding 1).
    handler.body_size = 1000
    quota = Quota(scope_bytes=1 << 20, total_bytes=1 << 20, client_bytes=2500)
    async with make(quota=quota, max_stored=1200) as c:
        codes = [
            (await c.post("/o", content=b"b", headers=keyed("k", cookie=f"s={i}"))).status_code
            for i in range(4)
        ]
    assert codes == [201, 201, 429, 429]
    assert handler.calls == 2
    full = Quota(scope_bytes=2500, total_bytes=2500, client_bytes=2500)
    app = IdempotencyMiddleware(handler, pool=pool, quota=full, max_stored=1200)
    transport = httpx.ASGITransport(app=app, client=("10.9.9.9", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        # The store holds the two responses above: another client finds it full.
        other = await c.post("/o", content=b"b", headers=keyed("k", authorization="Bearer x"))
    assert other.status_code == 503
    assert other.json()["cause"] == "quota"
    assert handler.calls == 2


@pytest.mark.parametrize(
    ("quota", "message"),
    [
        (Quota(scope_bytes=0), "quota.scope_bytes must be >= 1"),
        (Quota(scope_bytes=10, total_bytes=5), "quota.total_bytes must be >= quota.scope_bytes"),
        (Quota(client_bytes=0), "quota.client_bytes must be >= 1"),
        (Quota(scope_bytes=1000), "must hold max_stored=1048576 bytes"),
        ("8 MiB", "quota must be a porch Quota"),
    ],
)
def test_bad_quotas_are_configuration_errors(tmp_path: Path, quota: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(Handler(), pool=KeyPool(SQLiteStore(tmp_path)), quota=quota)


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_a_fenced_owner_is_sent_but_its_waiters_get_the_newer_owners_response(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The first owner loses its claim while it runs (what a lapsed lease is on a
    # network store; here the test drops the lock behind its back). Another
    # worker claims the key and stores its response; the first owner's save is
    # then fenced: its client still gets its response, nothing overwrites the
    # stored one, and the first worker's waiters are answered with the stored one.
    slow, fast = Handler(), Handler()
    slow.gate = asyncio.Event()
    fast.body_size = 10  # tells the two owners' responses apart
    stores = [SQLiteStore(tmp_path), SQLiteStore(tmp_path)]
    pools = [KeyPool(s, size=1) for s in stores]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(h, pool=p)),
            base_url="http://t",
        )
        for h, p in zip((slow, fast), pools, strict=True)
    ]
    try:
        owner = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await until(lambda: slow.calls == 1, "the first owner runs its handler")
        waiter = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await until(lambda: parked_waiters(pools[0]) == [1], "the waiter is parked on the key")
        [key] = [k for shard in pools[0]._shards for k in shard.parked]
        stores[0]._claims.end(key)  # the claim is lost behind the owner's back
        newer = await clients[1].post("/o", content=b"b", headers=keyed())
        assert newer.status_code == 201
        slow.gate.set()
        first, parked = await owner, await waiter
        assert first.status_code == 201
        assert "idempotent-replayed" not in first.headers
        assert parked.headers["idempotent-replayed"] == "true"
        assert parked.content == newer.content
        assert "fenced" in caplog.text
        clients[0].cookies.clear()  # the handler sets one; a cookie is another caller
        replay = await clients[0].post("/o", content=b"b", headers=keyed())
        assert replay.content == newer.content
        assert (slow.calls, fast.calls) == (1, 1)
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_closing_the_pool_fails_callers_parked_on_another_pools_claim(
    tmp_path: Path,
) -> None:
    handler = Handler()
    handler.gate = asyncio.Event()
    pools = [KeyPool(SQLiteStore(tmp_path), size=1) for _ in range(2)]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(handler, pool=p)),
            base_url="http://t",
        )
        for p in pools
    ]
    try:
        owner = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await until(lambda: handler.calls == 1, "the first pool's owner runs the handler")
        waiter = asyncio.create_task(clients[1].post("/o", content=b"b", headers=keyed()))
        await until(lambda: parked_waiters(pools[1]) == [1], "the waiter is parked on the claim")
        assert not waiter.done()
        await pools[1].close()
        assert (await asyncio.wait_for(waiter, 5)).status_code == 503
        handler.gate.set()
        assert (await owner).status_code == 201
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


@pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")
async def test_a_watch_that_cannot_start_fails_its_waiters_and_wedges_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = Handler()
    handler.gate = asyncio.Event()
    stores = [SQLiteStore(tmp_path), SQLiteStore(tmp_path)]
    pools = [KeyPool(s, size=1) for s in stores]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(handler, pool=p)),
            base_url="http://t",
        )
        for p in pools
    ]

    def no_thread(key: str, wake: Callable[[], None], retry_after: float | None) -> None:
        raise RuntimeError("can't start new thread")

    try:
        owner = asyncio.create_task(clients[0].post("/o", content=b"b", headers=keyed()))
        await until(lambda: handler.calls == 1, "the first pool's owner runs the handler")
        monkeypatch.setattr(stores[1], "claims", type("Broken", (), {"watch": no_thread})())
        refused = await clients[1].post("/o", content=b"b", headers=keyed())
        assert refused.status_code == 503
        assert parked_waiters(pools[1]) == []  # nothing left behind for the key
        handler.gate.set()
        assert (await owner).status_code == 201
        monkeypatch.undo()
        replay = await clients[1].post("/o", content=b"b", headers=keyed())
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()


@pytest.mark.parametrize("ofd", [True, False], ids=["ofd-locks", "no-ofd-locks"])
async def test_two_pools_sharing_one_store_object_run_a_key_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ofd: bool
) -> None:
    # One store object claims for both pools: the second pool finds the key held
    # (by this very process) and waits — through a watch thread on its own
    # descriptor with OFD locks, through the store's own wake-up without them.
    if ofd and not ofd_locks_available():
        pytest.skip("needs Linux OFD locks")
    if not ofd:
        monkeypatch.setattr("porch.store.sqlite.claims.ofd_locks_available", lambda: False)
    handler = Handler()
    handler.latency = 0.3
    store = SQLiteStore(tmp_path)
    pools = [KeyPool(store, size=1), KeyPool(store, size=1)]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=IdempotencyMiddleware(handler, pool=p)),
            base_url="http://t",
        )
        for p in pools
    ]
    try:
        responses = await asyncio.gather(
            *(clients[i % 2].post("/o", content=b"b", headers=keyed()) for i in range(6))
        )
    finally:
        for c in clients:
            await c.aclose()
        for p in pools:
            await p.close()
    assert handler.calls == 1
    assert {r.status_code for r in responses} == {201}
    assert {r.content for r in responses} == {b"call 1"}


async def test_rules_match_the_path_inside_a_mount(pool: KeyPool, handler: Handler) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    sub = IdempotencyMiddleware(handler, pool=pool, rules=IdempotencyRule("/o", methods=["POST"]))
    app = Starlette(routes=[Mount("/v1", app=sub)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", cookies=no_cookies()
    ) as c:
        first = await c.post("/v1/o", content=b"tea", headers=keyed())
        again = await c.post("/v1/o", content=b"tea", headers=keyed())
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert handler.calls == 1


@pytest.mark.parametrize("replays_count", [True, False])
async def test_the_order_of_the_middlewares_decides_whether_replays_count(
    pool: KeyPool, handler: Handler, replays_count: bool
) -> None:
    from porch import Limit, RateLimitMiddleware, Rule

    def limited(app: ASGIApp) -> ASGIApp:
        return RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(2, 3600)))

    def replaying(app: ASGIApp) -> ASGIApp:
        return IdempotencyMiddleware(app, pool=pool)

    # Limiter outside: every request counts. Idempotency outside: replays answer first.
    app = limited(replaying(handler)) if replays_count else replaying(limited(handler))
    transport = httpx.ASGITransport(app=app, client=("10.2.2.2", 4000))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", cookies=no_cookies()
    ) as c:
        same = [await c.post("/orders", headers={"Idempotency-Key": "a"}) for _ in range(3)]
        other = await c.post("/orders", headers={"Idempotency-Key": "b"})
    if replays_count:
        assert [r.status_code for r in same] == [201, 201, 429]
        assert other.status_code == 429
    else:
        assert [r.status_code for r in same] == [201, 201, 201]
        assert other.status_code == 201  # the second unit: the replays took none
    assert handler.calls == (1 if replays_count else 2)
