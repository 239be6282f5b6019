"""A shard with more than one batch in flight (remote stores): overlap, and replies in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from porch.errors import PoolClosedError, StoreError
from porch.idempotency._ownership import OWNER, Acquire, Complete, Report
from porch.pool._pool import KeyPool
from porch.store.base import (
    Hit,
    StoredResponse,
    StoreOp,
)
from porch.store.sqlite import SQLiteStore
from support import GatedStore, HitCall, spin, through_apply, until

pytestmark = pytest.mark.anyio


def send(pool: KeyPool, finished: list[HitCall]) -> HitCall:
    call = HitCall(Hit(["k"], [1], [1.0]), finished)
    pool.submit("k", call)
    return call


async def test_up_to_in_flight_batches_apply_at_once() -> None:
    store = GatedStore(in_flight=2)
    finished: list[HitCall] = []
    async with KeyPool(store, size=1) as pool:
        first = send(pool, finished)
        await until(lambda: len(store.batches) == 1)
        second = send(pool, finished)
        await until(lambda: len(store.batches) == 2)  # sent while the first is out
        third = send(pool, finished)
        await spin()
        assert len(store.batches) == 2  # no room: the third waits in the mailbox
        assert pool.statistics().queued == 1
        store.batches[0].gate.set()
        await until(lambda: len(store.batches) == 3)
        for batch in store.batches:
            batch.gate.set()
        await asyncio.gather(first.future, second.future, third.future)
    assert finished == [first, second, third]


async def test_replies_keep_batch_order_when_batches_finish_out_of_order() -> None:
    store = GatedStore(in_flight=3)
    finished: list[HitCall] = []
    async with KeyPool(store, size=1) as pool:
        calls = []
        for n in range(3):
            calls.append(send(pool, finished))
            await until(lambda n=n: len(store.batches) == n + 1)  # type: ignore[misc]
        store.batches[2].gate.set()
        store.batches[1].gate.set()
        await until(lambda: store.batches[1].applied and store.batches[2].applied)
        await spin()
        assert finished == []  # the first batch is still out: nobody is answered yet
        store.batches[0].gate.set()
        await asyncio.gather(*(c.future for c in calls))
    assert finished == calls


async def test_a_failed_batch_fails_only_its_calls_in_turn() -> None:
    store = GatedStore(in_flight=2)
    finished: list[HitCall] = []
    async with KeyPool(store, size=1) as pool:
        bad = send(pool, finished)
        await until(lambda: len(store.batches) == 1)
        good = send(pool, finished)
        await until(lambda: len(store.batches) == 2)
        store.batches[0].fail = StoreError("server went away")
        store.batches[1].gate.set()
        await until(lambda: store.batches[1].applied, "the second batch is done")
        await spin()
        assert not good.future.done()  # waits for the failed batch's turn
        store.batches[0].gate.set()
        with pytest.raises(StoreError, match="server went away"):
            await bad.future
        assert (await good.future).allowed
        # An unexpected exception becomes a StoreError too, and the shard lives on.
        odd = send(pool, finished)
        await until(lambda: len(store.batches) == 3)
        store.batches[2].fail = RuntimeError("driver bug")
        store.batches[2].gate.set()
        with pytest.raises(StoreError, match="driver bug"):
            await odd.future
        last = send(pool, finished)
        await until(lambda: len(store.batches) == 4)
        store.batches[3].gate.set()
        assert (await last.future).allowed
    assert finished == [good, last]


async def test_close_answers_the_batches_out_first() -> None:
    store = GatedStore(in_flight=2)
    finished: list[HitCall] = []
    pool = KeyPool(store, size=1)
    await pool.start()
    out = [send(pool, finished)]
    await until(lambda: len(store.batches) == 1)
    out.append(send(pool, finished))
    await until(lambda: len(store.batches) == 2)
    queued = send(pool, finished)
    closing = asyncio.create_task(pool.close())
    with pytest.raises(PoolClosedError):
        await queued.future
    await spin()
    assert not closing.done()
    assert not store.closed
    for batch in store.batches:
        batch.gate.set()
    await closing
    assert store.closed
    assert finished == out


class OverlappedSQLite(SQLiteStore):
    """The real SQLite store, driven by an overlapped shard; batches that save wait for ``gate``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        through_apply(self, in_flight=2)
        self.gate = asyncio.Event()
        self.held = False  # a Save waits at the gate
        self.applied = 0  # batches committed

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        if any(type(op).__name__ == "Save" for op in ops):
            self.held = True
            await self.gate.wait()
        await super().apply(ops)
        self.applied += 1


async def test_a_key_has_one_claim_out_while_its_save_is_in_flight(tmp_path: object) -> None:
    """An Acquire sent while its key's Save is out parks (no second claim), then replays."""
    store = OverlappedSQLite(str(tmp_path))
    response = StoredResponse(b"d" * 32, 201, ((b"content-type", b"text/plain"),), b"made")
    async with KeyPool(store, size=1) as pool:
        loop = asyncio.get_running_loop()
        first = Acquire(loop.create_future(), "s\x1fkey", b"d" * 32, 20.0)
        pool.submit("s\x1fkey", first)
        assert await first.future is OWNER
        report: asyncio.Future[Report] = loop.create_future()
        pool.submit(
            "s\x1fkey",
            Complete.of(report, "s\x1fkey", first.token, response, 60.0),
            must_deliver=True,
        )
        await until(lambda: store.held, "the Save is out, held at the gate")
        second = Acquire(loop.create_future(), "s\x1fkey", b"d" * 32, 20.0)
        pool.submit("s\x1fkey", second)
        finished: list[HitCall] = []
        other = HitCall(Hit(["other"], [5], [60.0]), finished)
        pool.submit("s\x1fkey", other)  # a later batch on the same shard
        # Committed (the first claim's batch and other's); the replies wait for the Save's turn.
        await until(lambda: store.applied == 2, "other's batch committed")
        await spin()
        assert not second.future.done()
        assert not other.future.done()
        store.gate.set()
        assert await report == "saved"
        assert await second.future == response  # parked on the key, answered by the Save
        assert (await other.future).allowed
