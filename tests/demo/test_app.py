from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from porch.demo import DemoConfig, create_app
from porch.ops.cli import main
from support import HOSTILE_BODIES, until

pytestmark = pytest.mark.anyio


async def test_storefront_routes(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=100))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        assert (await c.get("/health")).json() == {"ok": True}
        products = (await c.get("/products")).json()
        assert isinstance(products, list)
        assert products
        created = await c.post("/orders", json={"item": "tea", "qty": 2})
        assert created.status_code == 201
        assert created.json() == {"id": 1, "item": "tea", "qty": 2}
        listed = (await c.get("/orders")).json()
        assert listed == {"count": 1, "orders": [{"id": 1, "item": "tea", "qty": 2}], "next": None}
        for body, status in HOSTILE_BODIES:
            bad = await c.post("/orders", content=body)
            assert bad.status_code == status, (body[:40], bad.text)
            assert bad.headers["content-type"] == "application/problem+json"
            assert bad.json()["status"] == status
        assert (await c.get("/orders")).json()["count"] == 1
    await app.state.pool.close()


async def test_orders_compare_json_canonically(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=100))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    key = {"Idempotency-Key": "order-1", "Content-Type": "application/json"}
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        first = await c.post("/orders", content=b'{"item":"tea","qty":2}', headers=key)
        again = await c.post("/orders", content=b'{\n  "qty": 2,  "item": "tea"\n}', headers=key)
        other = await c.post("/orders", content=b'{"item":"tea","qty":3}', headers=key)
        assert (await c.get("/orders")).json()["count"] == 1
    await app.state.pool.close()
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert other.status_code == 422


async def test_every_body_is_capped(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=100))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    big = b'{"item": "' + b"x" * (30 << 20) + b'", "qty": 1}'

    async def streamed() -> AsyncIterator[bytes]:
        # No Content-Length: chunked, so only the reader's cap can stop it.
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        for headers in ({}, {"Idempotency-Key": "big-1"}):
            declared = await c.post("/orders", content=big, headers=headers)
            assert declared.status_code == 413, declared.text
            chunked = await c.post("/orders", content=streamed(), headers=headers)
            assert chunked.status_code == 413, chunked.text
            assert chunked.headers["content-type"] == "application/problem+json"
        # Any route: a declared body over the cap never reaches a handler.
        assert (await c.request("GET", "/products", content=big)).status_code == 413
        assert (await c.get("/orders")).json()["count"] == 0
    await app.state.pool.close()


async def test_orders_are_paginated(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=1000))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        for i in range(7):
            assert (await c.post("/orders", json={"item": f"i{i}", "qty": 1})).status_code == 201
        seen: list[int] = []
        after: int | None = 0
        while after is not None:
            page = (await c.get("/orders", params={"limit": 3, "after": after})).json()
            assert page["count"] == 7  # the host's total, on every page
            assert len(page["orders"]) <= 3
            seen += [o["id"] for o in page["orders"]]
            after = page["next"]
        assert seen == list(range(1, 8))
        whole = (await c.get("/orders")).json()
        assert [o["id"] for o in whole["orders"]] == seen
        assert whole["next"] is None
        for query in (
            "limit=0",
            "limit=1001",
            "limit=x",
            "after=-1",
            "after=1e3",
            "limit=1&limit=2",
            "after=" + "9" * 30,
            "limit=\u0661",
        ):
            bad = await c.get("/orders?" + query)
            assert bad.status_code == 400, query
            assert bad.headers["content-type"] == "application/problem+json"
    await app.state.pool.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--limit", "0"], "limit amount must be an integer >= 1"),
        (["--pool-size", "0"], "pool size must be >= 1"),
        (["--mailbox", "0"], "mailbox capacity must be >= 1"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--window", "-1"], "limit window must be > 0"),
        (["--burst", "5"], "--burst takes an integer >= 1 with --algorithm gcra, got 5 with fixed"),
        (["--algorithm", "gcra", "--burst", "0"], "--burst takes an integer >= 1"),
        (["--global-limit", "0"], "--global-limit must be >= 1, got 0"),
        (["--global-slice", "5"], "--global-slice takes 1 to --global-limit units, got 5"),
        (
            ["--global-limit", "10", "--global-slice", "5", "--algorithm", "sliding"],
            "--global-slice takes fixed windows",
        ),
        (["--token-budget", "0"], "--token-budget must be >= 1, got 0"),
        (["--plans", "free"], "--plans takes 'name=rate[;rate...]' pairs"),
        (["--plans", "free-x=1/s"], "--plans takes 'name=rate[;rate...]' pairs"),
        (["--plans", "a=1/s,a=2/s"], "--plans takes 'name=rate[;rate...]' pairs"),
        (["--plans", "free=5/fortnight"], "--plans: plan 'free': invalid rate '5/fortnight'"),
    ],
)
def test_demo_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


async def test_store_url_holds_counters_and_responses_data_dir_the_orders(tmp_path: Path) -> None:
    import sqlite3

    shared = tmp_path / "shared" / "store.sqlite3"
    hosts = [
        create_app(DemoConfig(data_dir=str(tmp_path / name), limit=4, store=f"sqlite:///{shared}"))
        for name in ("a", "b")
    ]
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=("10.0.0.7", 1234)),
            base_url="http://demo",
        )
        for app in hosts
    ]
    try:
        key = {"idempotency-key": "order-1"}
        first = await clients[0].post("/orders", json={"item": "tea", "qty": 1}, headers=key)
        again = await clients[1].post("/orders", json={"item": "tea", "qty": 1}, headers=key)
        assert first.status_code == again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"  # stored in the shared store
        assert again.content == first.content
        # Orders are each host's own: host a has one, host b none.
        listed = [await c.get("/orders") for c in clients]
        assert [r.json()["count"] for r in listed] == [1, 0]
        # Both hosts counted against one limit of 4: the fifth request is refused.
        assert (await clients[1].get("/products")).status_code == 429
    finally:
        for c in clients:
            await c.aclose()
        for app in hosts:
            await app.state.pool.close()
    assert not (tmp_path / "a" / "porch.sqlite3").exists()
    with sqlite3.connect(shared) as conn:
        assert conn.execute("SELECT count(*) FROM responses").fetchone()[0] == 1
    with sqlite3.connect(tmp_path / "a" / "orders.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone()[0] == 1
    with sqlite3.connect(tmp_path / "b" / "orders.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://localhost/shop", "unknown store URL scheme 'mysql'"),
        ("nonsense", "a store URL needs a scheme"),
        ("sqlite://host/x.sqlite3", "no host, query or fragment"),
    ],
)
def test_demo_rejects_a_bad_store_url_without_a_traceback(
    url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--store", url]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_demo_names_the_extra_when_the_driver_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "porch.store.postgres", None)
    assert main(["demo", "--store", "postgresql://porch@127.0.0.1:5432/porch"]) == 2
    assert "pip install 'porch[postgres]'" in capsys.readouterr().err


async def test_webhooks_process_each_event_once(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=1000, checkout_latency=0.2))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        event = {"id": "evt_1", "amount": 500}
        deliveries = await asyncio.gather(*(c.post("/webhooks", json=event) for _ in range(8)))
        assert {d.status_code for d in deliveries} == {200}
        first = deliveries[0].json()
        assert set(first) == {"id", "processed_at"}
        assert first["id"] == "evt_1"
        assert all(d.json() == first for d in deliveries)
        # Redelivered later, re-serialised, with no Idempotency-Key: the same answer.
        later = await c.post("/webhooks", content=b'{"amount": 500, "id": "evt_1"}')
        assert later.json() == first
        assert (await c.post("/webhooks", json={"id": "evt_2", "amount": 1})).status_code == 200
        assert (await c.get("/webhooks")).json() == {"processed": 2}
        other = await c.post("/webhooks", json={"id": "evt_1", "amount": 501})
        assert other.status_code == 422
        for body in [b"[]", b'{"id": 1, "amount": 1}', b'{"id": "x", "amount": true}', b"{"]:
            bad = await c.post("/webhooks", content=body)
            assert bad.status_code in (400, 422), body
            assert bad.headers["content-type"] == "application/problem+json"
        assert (await c.get("/webhooks")).json() == {"processed": 2}
    await app.state.pool.close()


async def test_exports_up_to_max_stored_are_stored_and_replayed(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=1000, max_stored=3 << 20))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        key = {"Idempotency-Key": "export-1"}
        first = await c.post("/exports", json={"size": (2 << 20) + 7}, headers=key)
        again = await c.post("/exports", json={"size": (2 << 20) + 7}, headers=key)
        big = {"Idempotency-Key": "export-2"}
        over = await c.post("/exports", json={"size": 4 << 20}, headers=big)
        rerun = await c.post("/exports", json={"size": 4 << 20}, headers=big)
        refused = [
            await c.post("/exports", json={"size": size}) for size in (-1, (100 << 20) + 1, "1")
        ]
    await app.state.pool.close()
    assert first.status_code == again.status_code == 201
    assert first.headers["content-type"] == "application/octet-stream"
    assert len(first.content) == (2 << 20) + 7
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["location"] == first.headers["location"]
    # Over --max-stored: sent whole, not stored; its retry runs again (other bytes).
    assert len(over.content) == len(rerun.content) == 4 << 20
    assert "idempotent-replayed" not in rerun.headers
    assert rerun.content != over.content
    assert [r.status_code for r in refused] == [422, 422, 422]


def test_demo_quota_holds_two_of_the_largest_responses() -> None:
    from porch.demo.exports import quota_bytes

    assert quota_bytes(1 << 20, 8 << 20) == 8 << 20  # the default stays
    assert quota_bytes(100 << 20, 8 << 20) >= 2 * (100 << 20)


async def test_max_in_flight_caps_one_clients_checkouts(tmp_path: Path) -> None:
    config = DemoConfig(data_dir=str(tmp_path), limit=100, checkout_latency=1.0, max_in_flight=2)
    app = create_app(config)
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    other = httpx.ASGITransport(app=app, client=("10.0.0.6", 1234))
    order = {"item": "tea", "qty": 1}
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://demo") as c,
        httpx.AsyncClient(transport=other, base_url="http://demo") as d,
    ):
        checkouts = [asyncio.ensure_future(c.post("/orders", json=order)) for _ in range(2)]
        await until(lambda: app.state.pool.store.statistics().operations >= 2)
        # Two checkouts of this client are in flight (each waits for the payment provider).
        refused = await c.post("/orders", json=order)
        assert (await c.get("/products")).status_code == 200  # not capped
        assert (await d.post("/orders", json=order)).status_code == 201  # another client
        done = await asyncio.gather(*checkouts)
        again = await c.post("/orders", json=order)
    await app.state.pool.close()
    assert [r.status_code for r in done] == [201, 201]
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["violated"][0]["policy"] == "in-flight"
    assert '"in-flight";q=2;qu="concurrent-requests"' in refused.headers["ratelimit-policy"]
    assert again.status_code == 201


def test_max_in_flight_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--max-in-flight", "0"]) == 2
    assert "--max-in-flight must be >= 1, got 0" in capsys.readouterr().err


async def test_completions_reserve_max_tokens_and_settle_what_was_used(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), token_budget=100, window=60))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://demo") as c,
    ):
        first = await c.post("/completions", json={"prompt": "one two three", "max_tokens": 90})
        # 90 were reserved, 3 used: 97 are left, so 95 fits now; 98 would not.
        big = await c.post("/completions", json={"prompt": "x " * 200, "max_tokens": 95})
        over = await c.post("/completions", json={"prompt": "y", "max_tokens": 3})
        bad = [
            await c.post("/completions", content=b"[1]"),
            await c.post("/completions", content=b"{nope"),
            await c.post("/completions", json={"prompt": 1, "max_tokens": 1}),
            await c.post("/completions", json={"prompt": "a", "max_tokens": 0}),
            await c.post("/completions", json={"prompt": "a", "max_tokens": 100_001}),
            await c.post("/completions", json={"prompt": "a", "max_tokens": True}),
        ]
        other = await c.get("/products")  # the app's own limit, not the token budget
    assert (first.status_code, first.json()) == (200, {"tokens": 3})
    assert first.headers["ratelimit-policy"] == '"tokens";q=100;w=60'
    assert first.headers["ratelimit"] == '"tokens";r=10;t=60'  # told at the reservation
    assert (big.status_code, big.json()) == (200, {"tokens": 95})
    assert over.status_code == 429  # 3 + 95 + 3 > 100
    assert over.json()["level"] == "client"
    assert [r.status_code for r in bad] == [400, 400, 422, 422, 422, 422]
    assert all(r.headers["content-type"] == "application/problem+json" for r in bad)
    assert other.headers["ratelimit-policy"] == '"demo";q=60;w=60'


async def test_a_global_level_and_plans(tmp_path: Path) -> None:
    config = DemoConfig(
        data_dir=str(tmp_path), limit=2, global_limit=5, plans="free=1/minute,pro=3/minute"
    )
    app = create_app(config)

    def at(peer: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(peer, 1234))
        return httpx.AsyncClient(transport=transport, base_url="http://demo")

    pro = {"Authorization": "Bearer pro-abc"}
    async with app.router.lifespan_context(app), at("10.0.0.1") as a, at("10.0.0.2") as b:
        planned = [(await a.get("/products", headers=pro)).status_code for _ in range(4)]
        refused_by_plan = await b.get("/products", headers=pro)  # the same token, elsewhere
        unknown = [
            (await a.get("/products", headers={"Authorization": "Bearer gold-x"})).status_code
            for _ in range(3)
        ]
        by_global = await b.get("/products")
    assert planned == [200, 200, 200, 429]
    assert refused_by_plan.json()["level"] == "client"
    assert unknown == [200, 200, 429]  # no such plan: --limit per client
    # 3 (pro) + 2 (10.0.0.1) = 5: the global level is full for everyone.
    assert (by_global.status_code, by_global.json()["level"]) == (429, "global")
    assert by_global.headers["ratelimit-policy"] == '"demo";q=2;w=60, "global";q=5;w=60'
