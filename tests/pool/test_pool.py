from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from porch._types import Message, Receive, Scope, Send
from porch.errors import ConfigurationError, PoolClosedError, SaturatedError, StoreError
from porch.pool._pool import KeyPool, Shard
from porch.store.base import Hit, StoreOp
from porch.store.sqlite import SQLiteStore
from support import GatedStore, HitCall, spin, until

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("size", "mailbox", "message"),
    [(0, 1, "pool size must be >= 1, got 0"), (1, 0, "mailbox capacity must be >= 1, got 0")],
)
def test_bad_sizes_are_configuration_errors(size: int, mailbox: int, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        KeyPool(GatedStore(), size=size, mailbox=mailbox)


def test_the_default_size_is_the_stores_own(tmp_path: Path) -> None:
    from porch.store.postgres import PostgresStore
    from porch.store.redis import RedisStore

    # SQLite's one writer commits every shard's batches together: one shard.
    assert KeyPool(SQLiteStore(tmp_path)).size == 1
    assert PostgresStore("postgresql://h/db").capabilities.shards == 4
    assert RedisStore("redis://h/0").capabilities.shards == 4
    assert KeyPool(GatedStore()).size == 4  # a store that keeps the default
    assert KeyPool(SQLiteStore(tmp_path), size=3).size == 3


def test_shard_index_is_stable_and_spreads_keys() -> None:
    pool = KeyPool(GatedStore(), size=8)
    # crc32 is fixed across processes and runs (Python's hash() is salted).
    assert pool.shard_index("client-1") == pool.shard_index("client-1")
    assert pool.shard_index("127.0.0.1") == zlib.crc32(b"127.0.0.1") % 8
    assert len({pool.shard_index(f"k{i}") for i in range(200)}) == 8


async def test_calls_are_answered_after_the_batch_commits() -> None:
    store = GatedStore()
    async with KeyPool(store, size=1, mailbox=100) as pool:
        calls = [HitCall(Hit(["k"], [1], [1.0])) for _ in range(3)]
        for c in calls:
            pool.submit("k", c)
        await until(lambda: store.sizes() == [3], "the batch reached the store")
        await spin()
        assert not any(c.future.done() for c in calls)
        store.open_gates()
        results = await asyncio.gather(*(c.future for c in calls))
        assert all(h.allowed for h in results)
        assert store.sizes() == [3]  # one drain, one transaction


async def test_saturated_shard_refuses_at_once() -> None:
    store = GatedStore()
    async with KeyPool(store, size=1, mailbox=2) as pool:
        first = HitCall(Hit(["k"], [1], [1.0]))
        pool.submit("k", first)
        await until(lambda: store.sizes() == [1], "the shard took it and waits on the store")
        pool.submit("k", HitCall(Hit(["k"], [1], [1.0])))
        pool.submit("k", HitCall(Hit(["k"], [1], [1.0])))
        with pytest.raises(SaturatedError):
            pool.submit("k", HitCall(Hit(["k"], [1], [1.0])))
        stats = pool.statistics()
        assert (stats.queued, stats.calls, stats.saturations) == (2, 3, 1)
        store.open_gates()
        await first.future


async def test_store_failure_fails_the_batch_and_the_shard_lives_on() -> None:
    store = GatedStore()
    store.fail = RuntimeError("disk on fire")
    store.open_gates()
    async with KeyPool(store, size=1) as pool:
        bad = HitCall(Hit(["k"], [1], [1.0]))
        pool.submit("k", bad)
        with pytest.raises(StoreError, match="disk on fire"):
            await bad.future
        store.fail = None
        good = HitCall(Hit(["k"], [1], [1.0]))
        pool.submit("k", good)
        assert (await good.future).allowed


async def test_close_wakes_every_queued_caller() -> None:
    store = GatedStore()
    pool = KeyPool(store, size=1, mailbox=10)
    await pool.start()
    running = HitCall(Hit(["k"], [1], [1.0]))
    pool.submit("k", running)
    await until(lambda: store.sizes() == [1], "the first call reached the store")
    queued = [HitCall(Hit(["k"], [1], [1.0])) for _ in range(3)]
    for c in queued:
        pool.submit("k", c)
    closing = asyncio.create_task(pool.close())
    for c in queued:
        with pytest.raises(PoolClosedError, match="closed before this call was answered"):
            await asyncio.wait_for(c.future, 10)
    assert not closing.done()  # it waits for the batch in flight
    store.open_gates()
    await closing
    assert (await running.future).allowed  # the batch in flight still completes
    with pytest.raises(PoolClosedError):
        pool.submit("k", HitCall(Hit(["k"], [1], [1.0])))


async def test_pool_counts_exactly_under_concurrency(tmp_path: Path) -> None:
    async with KeyPool(SQLiteStore(tmp_path), size=4, mailbox=1000) as pool:
        calls = [HitCall(Hit(["one"], [150], [60.0])) for _ in range(200)]
        for c in calls:
            pool.submit("one", c)
        results = await asyncio.gather(*(c.future for c in calls))
        assert sum(h.allowed for h in results) == 150
        assert pool.statistics().store.transactions < 200


async def test_a_closed_pool_can_start_again(tmp_path: Path) -> None:
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    for _ in range(2):
        await pool.start()
        call = HitCall(Hit(["k"], [10], [60.0]))
        pool.submit("k", call)
        assert (await call.future).allowed
        assert pool.statistics().calls == 1  # fresh actors after a restart
        await pool.close()


async def test_hooks_run_as_the_pool_closes_while_its_actors_still_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    answered: list[bool] = []

    async def failing() -> None:
        raise RuntimeError("this hook fails")

    async def hand_back() -> None:
        call = HitCall(Hit(["k"], [10], [60.0]))
        pool.submit("k", call)
        answered.append((await call.future).allowed)

    pool.before_close(failing)  # logged; never in the way of the close or the next hook
    pool.before_close(hand_back)
    await pool.start()
    await pool.close()
    assert answered == [True]
    assert "a hook run as the pool closed failed: RuntimeError('this hook fails')" in caplog.text
    assert not pool.started
    await pool.close()  # closed: the hooks do not run again
    assert answered == [True]


async def test_a_failing_call_does_not_kill_its_shard() -> None:
    class Broken(HitCall):
        def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
            raise RuntimeError("bug in a call")

    store = GatedStore()
    store.open_gates()
    async with KeyPool(store, size=1) as pool:
        broken = Broken(Hit(["k"], [1], [1.0]))
        pool.submit("k", broken)
        with pytest.raises(StoreError, match="bug in a call"):
            await broken.future
        good = HitCall(Hit(["k"], [1], [1.0]))
        pool.submit("k", good)
        assert (await good.future).allowed


def test_a_pool_left_open_closes_with_its_event_loop(tmp_path: Path) -> None:
    """A server without lifespan never closes the pool: its loop's end does (asyncio.run
    cancels every task left, the pool's keeper too, which closes the store)."""
    import threading

    from porch import Limit, RateLimitMiddleware, Rule

    pool = KeyPool(SQLiteStore(tmp_path))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def serve_one_request() -> list[Message]:
        limited = RateLimitMiddleware(app, pool=pool, rules=Rule(Limit(5, 60)))
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        async def receive() -> Message:
            return {"type": "http.request"}

        scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "client": ("1", 1)}
        await limited(scope, receive, send)  # opens the pool: no lifespan here
        assert (tmp_path / "porch.sqlite3-wal").exists()
        return sent

    sent = asyncio.run(serve_one_request())
    assert sent[0]["status"] == 204
    assert not (tmp_path / "porch.sqlite3-wal").exists()  # the store was closed
    assert not [t for t in threading.enumerate() if t.name.startswith("porch-sqlite")]
