"""PorchMetrics: what the middlewares and the pool report, read back from a real scrape."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from porch import (
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    PorchMetrics,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch._types import Receive, Scope, Send

pytestmark = pytest.mark.anyio


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


async def scrape(metrics: PorchMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    transport = httpx.ASGITransport(app=metrics.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
        response = await c.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


async def test_every_outcome_is_counted(tmp_path: Path) -> None:
    metrics = PorchMetrics()
    pool = KeyPool(SQLiteStore(tmp_path), size=2, metrics=metrics)
    release = asyncio.Event()
    held = asyncio.Event()  # the /slow owner is inside the handler, holding its key

    async def shop(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            held.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    idem = IdempotencyMiddleware(
        shop, pool=pool, rules=IdempotencyRule("/"), max_body=10, wait_timeout=0.2
    )
    app = RateLimitMiddleware(idem, pool=pool, rules=Rule(Limit(12, 60, name="burst"), name="site"))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.1", 1234))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            def post(body: bytes, key: str, path: str = "/o") -> Awaitable[httpx.Response]:
                return c.post(path, content=body, headers={"Idempotency-Key": key})

            assert (await post(b"a", "k1")).status_code == 201  # executed
            assert (await post(b"a", "k1")).status_code == 201  # replayed
            assert (await post(b"a", "k1")).status_code == 201  # replayed
            assert (await post(b"b", "k1")).status_code == 422  # mismatch
            assert (await post(b"x" * 11, "k2")).status_code == 413  # too_large
            assert (await c.post("/o", headers={b"Idempotency-Key": b"\xff"})).status_code == 400
            owner = asyncio.ensure_future(post(b"s", "k3", "/slow"))  # executed, held
            await asyncio.wait_for(held.wait(), 10)
            assert (await post(b"s", "k3", "/slow")).status_code == 409  # conflict
            release.set()
            await owner
            for _ in range(8):  # 8 keyed requests so far: 16 in all, 12 allowed, 4 refused
                await c.get("/free")
            after = await scrape(metrics)
    finally:
        await pool.close()

    def idem_count(outcome: str) -> float:
        return after[("porch_idempotency_requests_total", (("outcome", outcome),))]

    assert idem_count("executed") == 2
    assert idem_count("replayed") == 2
    assert idem_count("mismatch") == 1
    assert idem_count("too_large") == 1
    assert idem_count("invalid") == 1
    assert idem_count("conflict") == 1
    rl = "porch_ratelimit_requests_total"
    assert after[(rl, (("outcome", "allowed"), ("rule", "site")))] == 12
    assert after[(rl, (("outcome", "refused"), ("rule", "site")))] == 16 - 12
    commits = after[("porch_store_commit_seconds_count", ())]
    assert commits >= 1
    assert after[("porch_store_operations_per_commit_sum", ())] >= 16  # every hit is an op
    assert after[("porch_mailbox_depth", (("shard", "0"),))] == 0
    assert after[("porch_parked_waiters", (("shard", "1"),))] == 0


async def test_saturation_and_parked_waiters_are_reported(tmp_path: Path) -> None:
    metrics = PorchMetrics()
    # Every commit through the writer thread (power: never inline), so the mailbox fills.
    store = SQLiteStore(tmp_path, durability="power")
    pool = KeyPool(store, size=1, mailbox=2, metrics=metrics)
    app = RateLimitMiddleware(_ok, pool=pool, rules=Rule(Limit(10_000, 60)))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.1", 1234))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            statuses = [
                r.status_code for r in await asyncio.gather(*(c.get("/") for _ in range(200)))
            ]
        after = await scrape(metrics)
    finally:
        await pool.close()
    assert after[("porch_unavailable_total", (("cause", "saturated"),))] == statuses.count(503)
    assert statuses.count(503) > 0
    assert after[("porch_unavailable_total", (("cause", "store"),))] == 0


async def test_two_metrics_objects_share_nothing(tmp_path: Path) -> None:
    # No global state: two apps in one process each count their own requests.
    one, two = PorchMetrics(), PorchMetrics()
    for metrics, n in ((one, 3), (two, 5)):
        pool = KeyPool(SQLiteStore(tmp_path / str(n)), metrics=metrics)
        app = RateLimitMiddleware(_ok, pool=pool, rules=Rule(Limit(100, 60)))
        transport = httpx.ASGITransport(app=app, client=("10.0.0.1", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(n):
                await c.get("/")
        await pool.close()
    key = ("porch_ratelimit_requests_total", (("outcome", "allowed"), ("rule", "default")))
    assert (await scrape(one))[key] == 3
    assert (await scrape(two))[key] == 5


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_requests_refused_over_quota_are_counted(tmp_path: Path) -> None:
    from porch import Quota

    metrics = PorchMetrics()
    pool = KeyPool(SQLiteStore(tmp_path), size=1, metrics=metrics)

    async def big(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 1000})

    quota = Quota(scope_bytes=2000, total_bytes=2000, client_bytes=2000)
    app = IdempotencyMiddleware(big, pool=pool, quota=quota, max_stored=1100)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            codes = [
                (await c.post("/o", content=b"{}", headers={"idempotency-key": key})).status_code
                for key in ("a", "b", "c")
            ]
        found = await scrape(metrics)
    finally:
        await pool.close()
    # The first stores ~1 kB; the next two cannot reserve 1100 more: refused, never run.
    assert codes == [201, 429, 429]
    assert found[("porch_idempotency_requests_total", (("outcome", "quota"),))] == 2
    assert found[("porch_idempotency_unstored_total", (("reason", "quota"),))] == 0
    assert found[("porch_idempotency_unstored_total", (("reason", "fenced"),))] == 0
