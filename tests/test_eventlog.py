"""Refusals are logged with structured fields, throttled so a flood cannot flood the log."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch._eventlog import EventLog
from porch._types import Receive, Scope, Send

pytestmark = pytest.mark.anyio


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def records(caplog: pytest.LogCaptureFixture, outcome: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "outcome", None) == outcome]


def test_throttle_once_per_key_per_interval_with_suppressed_count() -> None:
    log = EventLog(logging.getLogger("porch.test"), rate=1000)
    assert log.event(logging.ERROR, "a", 0.0, 10.0, "x")
    assert not any(log.event(logging.ERROR, "a", t / 10, 10.0, "x") for t in range(99))
    assert log.event(logging.ERROR, "b", 1.0, 10.0, "x")  # another key is its own
    assert log.event(logging.ERROR, "a", 10.0, 10.0, "x")  # the interval ended


def test_throttle_memory_is_bounded_and_rate_capped(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(logging.getLogger("porch.test"), capacity=100, rate=5)
    caplog.set_level(logging.INFO, logger="porch.test")
    written = sum(log.event(logging.ERROR, n, n / 1000, 60.0, "x") for n in range(10_000))
    # 10 s of distinct keys at 1000/s: at most 5 lines a second, and 100 keys remembered.
    assert 5 <= written <= 5 * 11
    assert len(log._entries) <= 100
    # Nothing vanishes silently: every line not written is counted on a later line.
    dropped = sum(r.dropped for r in caplog.records)  # type: ignore[attr-defined]
    assert written + dropped > 10_000 - 1000
    with pytest.raises(ConfigurationError, match="capacity must be >= 1"):
        EventLog(logging.getLogger("porch.test"), capacity=0)


async def test_a_flood_of_429s_is_one_line_per_client_and_rule(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="porch")
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(2, 60, name="api"), name="site"))
    statuses: list[int] = []
    for peer in ("10.0.0.1", "10.0.0.2"):
        transport = httpx.ASGITransport(app=app, client=(peer, 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(10):
                responses = await asyncio.gather(*(c.get("/x") for _ in range(20)))
                statuses += [r.status_code for r in responses]
    refused = records(caplog, "refused")
    assert statuses.count(429) == 2 * (200 - 2)
    # One line per client (and rule) for the whole window, not one per 429.
    assert sorted(r.client for r in refused) == ["10.0.0.1", "10.0.0.2"]  # type: ignore[attr-defined]
    for r in refused:
        assert r.rule == "site"  # type: ignore[attr-defined]
        assert r.status == 429  # type: ignore[attr-defined]
        assert r.name == "porch.ratelimit"
        assert r.levelno == logging.WARNING


async def test_saturation_is_logged_once_a_second_per_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="porch")
    pool = KeyPool(SQLiteStore(tmp_path), size=1, mailbox=1)
    app = RateLimitMiddleware(hello, pool=pool, rules=Rule(Limit(10_000, 60)))
    try:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            loop = asyncio.get_running_loop()
            started = loop.time()
            statuses = [
                r.status_code for r in await asyncio.gather(*(c.get("/x") for _ in range(300)))
            ]
            elapsed = loop.time() - started
    finally:
        await pool.close()
    saturated = statuses.count(503)
    assert saturated > 10, statuses  # the flood did saturate the one-slot mailbox
    lines = [r for r in caplog.records if getattr(r, "cause", None) == "saturated"]
    assert 1 <= len(lines) <= elapsed + 1, (len(lines), elapsed)
    assert lines[0].shard == 0  # type: ignore[attr-defined]


async def test_idempotency_refusals_are_logged(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="porch")

    async def created(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made"})

    app = IdempotencyMiddleware(
        created, pool=pool, rules=IdempotencyRule("/", required=True), max_body=10
    )
    transport = httpx.ASGITransport(app=app, client=("10.0.0.1", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.post("/o", content=b"a", headers={"Idempotency-Key": "k"})).is_success
        assert (
            await c.post("/o", content=b"b", headers={"Idempotency-Key": "k"})
        ).status_code == 422
        big = await c.post("/o", content=b"x" * 11, headers={"Idempotency-Key": "k2"})
        assert big.status_code == 413
        assert (await c.post("/o", content=b"a")).status_code == 400
        assert (await c.post("/o", headers={b"Idempotency-Key": "é".encode()})).status_code == 400
    assert len(records(caplog, "mismatch")) == 1
    assert len(records(caplog, "too_large")) == 1
    invalid = records(caplog, "invalid")
    assert len(invalid) == 1  # the second 400 of the same caller within a second is suppressed
    assert invalid[0].scope == "client:10.0.0.1"  # type: ignore[attr-defined]
    assert invalid[0].status == 400  # type: ignore[attr-defined]
