"""Big saves do not stall other callers' decisions (issue 12): a shard answers its
other callers while a big save of its batch is still out, on the real SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Sequence

import pytest

from porch.errors import StoreError
from porch.idempotency._ownership import OWNER, Acquire, Complete, Report
from porch.pool._pool import Call, KeyPool
from porch.store.base import Hit, Lookup, Save, StoredResponse, StoreOp
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite.saves import BLOB_ABOVE
from support import HitCall, through_apply

pytestmark = pytest.mark.anyio

KEY = "s\x1fkey"
DIGEST = b"d" * 32
BIG = StoredResponse(DIGEST, 201, ((b"content-type", b"text/plain"),), b"x" * (1 << 20))
DEADLINE = 10.0  # bounds every wait; none of them decides an order


class HeldSaves(SQLiteStore):
    """The real store; a batch saving a big body is held at its door until ``release``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        through_apply(self)
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        if any(type(op) is Save and len(op.response.body) > BLOB_ABOVE for op in ops):
            self.arrived.set()
            # Bounded too: where the shard waits for it, a failed test must still close its pool.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), 2 * DEADLINE)
        await super().apply(ops)


async def own(pool: KeyPool) -> Acquire:
    first = Acquire(asyncio.get_running_loop().create_future(), KEY, DIGEST, 20.0)
    pool.submit(KEY, first)
    assert await asyncio.wait_for(first.future, DEADLINE) is OWNER
    return first


def report(pool: KeyPool, owner: Acquire, calls: list[Call]) -> asyncio.Future[Report]:
    """The owner's big save and ``calls`` in the shard's mailbox together: one batch."""
    done: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
    pool.submit(KEY, Complete.of(done, KEY, owner.token, BIG, 60.0), must_deliver=True)
    for call in calls:
        pool.submit(KEY, call)
    return done


async def test_decisions_are_answered_while_a_big_save_is_out(tmp_path: object) -> None:
    store = HeldSaves(str(tmp_path))
    async with KeyPool(store, size=1) as pool:
        owner = await own(pool)
        same_batch = HitCall(Hit(["a"], [5], [60.0]))
        saved = report(pool, owner, [same_batch])
        await asyncio.wait_for(store.arrived.wait(), DEADLINE)
        # In the big save's batch, and in a batch sent after it started: both committed.
        later = HitCall(Hit(["b"], [5], [60.0]))
        pool.submit(KEY, later)
        for call in (same_batch, later):
            assert (await asyncio.wait_for(call.future, DEADLINE)).allowed
        # A caller for the saving key parks on it (no second claim), and gets its response.
        again = Acquire(asyncio.get_running_loop().create_future(), KEY, DIGEST, 20.0)
        pool.submit(KEY, again)
        assert not saved.done()
        assert not again.future.done()
        store.release.set()
        assert await asyncio.wait_for(saved, DEADLINE) == "saved"
        assert await asyncio.wait_for(again.future, DEADLINE) == BIG
        lookup = Lookup(KEY)
        await store.apply([lookup])
        assert lookup.result == BIG


async def test_a_big_save_that_fails_fails_its_owner_only(tmp_path: object) -> None:
    store = HeldSaves(str(tmp_path))
    async with KeyPool(store, size=1) as pool:
        owner = await own(pool)
        hit = HitCall(Hit(["a"], [5], [60.0]))
        saved = report(pool, owner, [hit])
        await asyncio.wait_for(store.arrived.wait(), DEADLINE)
        assert (await asyncio.wait_for(hit.future, DEADLINE)).allowed
        again = Acquire(asyncio.get_running_loop().create_future(), KEY, DIGEST, 20.0)
        pool.submit(KEY, again)
        with contextlib.closing(sqlite3.connect(store.path)) as conn:  # fails inside SQLite
            conn.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON responses"
                " BEGIN SELECT RAISE(ABORT, 'disk full'); END"
            )
        store.release.set()
        with pytest.raises(StoreError):
            await asyncio.wait_for(saved, DEADLINE)
        # The claim ended with the failed save: the parked caller claims again and owns the key.
        assert await asyncio.wait_for(again.future, DEADLINE) is OWNER
