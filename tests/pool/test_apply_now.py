"""A hit committed on its request's task when nothing else is in flight (KeyPool.apply_now).

One client at a time skips the mailbox, the shard's task and the reply's hop;
concurrent clients still meet in the shards' group commits. Either way every
decision is read-decide-write under the store's write lock, so the allowed
responses and the stored count agree exactly whatever mix of the two paths ran.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from porch import KeyPool, Limit, ManualClock, RateLimitMiddleware, Rule, SQLiteStore
from porch._types import ASGIApp, Receive, Scope, Send
from porch.store.base import Durability

pytestmark = pytest.mark.anyio


class Counted:
    """The app behind the limiter: counts the requests it served."""

    def __init__(self) -> None:
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.served += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def client(app: ASGIApp, peer: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def stored_count(directory: Path) -> int:
    """What the rows say the clients used, read by a connection of our own."""
    with sqlite3.connect(directory / "porch.sqlite3") as db:
        (total,) = db.execute("SELECT coalesce(sum(count), 0) FROM counts").fetchone()
    return int(total)


def batches(pool: KeyPool) -> int:
    """Batches the shards' tasks took from their mailboxes."""
    return sum(s.batches for s in pool.statistics().shards)


async def opened(directory: Path, durability: Durability = "process") -> KeyPool:
    clock = ManualClock(monotonic=100.0, wall=1_700_000_000.0)
    pool = KeyPool(SQLiteStore(directory, durability=durability, clock=clock), size=2)
    await pool.start()
    return pool


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[KeyPool]:
    p = await opened(tmp_path)
    yield p
    await p.close()


async def test_one_client_at_a_time_commits_without_the_mailbox(
    pool: KeyPool, tmp_path: Path
) -> None:
    app = Counted()
    limiter = RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(5, 60)), refusal_memory=0)
    statuses = []
    async with client(limiter, "10.0.0.1") as c:
        for _ in range(8):
            statuses.append((await c.get("/")).status_code)
            # Over a network the next request comes in a later loop iteration; through
            # ASGITransport it would come in this one, which reads as a second client.
            await asyncio.sleep(0)
    assert statuses == [200] * 5 + [429] * 3
    assert batches(pool) == 0  # no shard task took a batch: each committed on its own task
    statistics = pool.statistics()
    assert statistics.calls == 8  # still counted as calls to the shards
    assert statistics.store.transactions == 8  # one commit each, before each answer
    assert stored_count(tmp_path) == 5 == app.served


async def test_power_durability_never_commits_on_the_loop(tmp_path: Path) -> None:
    pool = await opened(tmp_path, durability="power")
    try:
        limiter = RateLimitMiddleware(Counted(), pool=pool, rules=Rule(Limit(5, 60)))
        async with client(limiter, "10.0.0.1") as c:
            for _ in range(3):
                assert (await c.get("/")).status_code == 200
                await asyncio.sleep(0)  # as in the test above
        assert batches(pool) == 3  # every hit went to the writer (fsync) through its shard
    finally:
        await pool.close()
    assert stored_count(tmp_path) == 3


async def test_concurrent_clients_are_counted_exactly_across_both_paths(
    pool: KeyPool, tmp_path: Path
) -> None:
    # Waves of 1 to 12 concurrent requests over 3 clients that share one limit each:
    # a lone request commits on its own task, a crowd goes through the shards, and a
    # wave's first request may take the direct path while the rest queue behind it.
    limit = 40
    app = Counted()
    limiter = RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(limit, 60)), refusal_memory=0)
    rng = random.Random(14)
    peers = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    clients = {peer: client(limiter, peer) for peer in peers}
    sent = dict.fromkeys(peers, 0)
    allowed = dict.fromkeys(peers, 0)
    try:
        for _ in range(60):
            wave = [rng.choice(peers) for _ in range(rng.choice((1, 1, 2, 3, 12)))]
            responses = await asyncio.gather(*(clients[peer].get("/") for peer in wave))
            for peer, response in zip(wave, responses, strict=True):
                assert response.status_code in (200, 429)
                sent[peer] += 1
                allowed[peer] += response.status_code == 200
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # a wave may start while the last one's replies go out
    finally:
        for c in clients.values():
            await c.aclose()
    for peer in peers:
        assert allowed[peer] == min(sent[peer], limit), (peer, sent[peer], allowed[peer])
    assert app.served == sum(allowed.values()) == stored_count(tmp_path)
    statistics = pool.statistics()
    assert statistics.calls == sum(sent.values())
    # Both paths ran: some hits were batched by the shards, some committed directly.
    assert 0 < batches(pool) < statistics.calls
    assert statistics.store.transactions < statistics.calls  # the crowds shared commits
