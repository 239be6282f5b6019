"""A network store's server stopped, frozen or restarted: fail fast, recover by itself.

Each test starts a server of its own (tests/servers.py), since it stops or
freezes it. Redis keeps an AOF synced at every write here, so a restart keeps
what was committed, as PostgreSQL does. The store's default timeouts are ≤ 5 s:
an operation against a stopped or frozen server raises StoreError within that
(plus slack for a loaded machine), never hangs; once the server is back the same
store object serves again, without being reopened. SQLite has no server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from porch.errors import StoreError
from porch.store.base import Claim, Hit, Release, Settle, Store, Vacate
from servers import PostgresServer, RedisServer, running_postgres, running_redis
from support import used

from .conftest import Backend, hit_on, report_of
from .model import Model, Policy, Report
from .test_watch import Waiter

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

Op = TypeVar("Op", Claim, Release, Hit)

FAILS_WITHIN = 7.0  # the ≤ 5 s default timeouts, plus a loaded machine's slack
BACK_WITHIN = 20.0


@contextlib.contextmanager
def own_server(backend: Backend) -> Iterator[PostgresServer | RedisServer]:
    if backend.name == "postgres":
        with running_postgres() as pg:
            yield pg
    elif backend.name == "redis":
        with running_redis(appendonly=True, appendfsync="always") as redis:
            yield redis
    elif backend.name == "redis-cluster":
        pytest.skip("a cluster's primary lost: tests/e2e/test_gate_cluster.py (failover)")
    elif backend.name.startswith("sharded"):
        pytest.skip("a sharded store's homes lost: tests/store/sharded/test_sharded_failures.py")
    else:
        pytest.skip("SQLite has no server to lose")


async def count(store: Store, key: str) -> Hit:
    hit = Hit([key], [1000], [3600.0])
    await store.apply([hit])
    return hit


async def fails_fast(store: Store) -> float:
    """Seconds until an operation raises StoreError (never a hang: 30 s is a failure)."""
    started = time.monotonic()
    with pytest.raises(StoreError):
        await asyncio.wait_for(count(store, "probe"), 30.0)
    return time.monotonic() - started


async def served_again(store: Store) -> float:
    """Seconds until the same store object serves again."""
    started = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(count(store, "probe"), BACK_WITHIN)
            return time.monotonic() - started
        except StoreError:
            if time.monotonic() - started > BACK_WITHIN:
                raise
            await asyncio.sleep(0.2)


async def test_a_stopped_server_fails_fast_and_the_store_recovers(backend: Backend) -> None:
    with own_server(backend) as server:
        on = backend.on(server.url)
        try:
            store = await on.store()
            assert used(await count(store, "kept")) == [1]
            server.stop()
            assert await fails_fast(store) < FAILS_WITHIN
            server.start()
            assert await served_again(store) < BACK_WITHIN
            # What was committed before the stop is still there.
            assert used(await count(store, "kept")) == [2]
        finally:
            await on.close()


async def test_a_frozen_server_fails_fast_and_the_store_recovers(backend: Backend) -> None:
    with own_server(backend) as server:
        on = backend.on(server.url)
        try:
            store = await on.store()
            assert used(await count(store, "kept")) == [1]
            server.freeze()
            try:
                assert await fails_fast(store) < FAILS_WITHIN
            finally:
                server.thaw()
            assert await served_again(store) < BACK_WITHIN
            assert used(await count(store, "kept")) == [2]
        finally:
            await on.close()


async def test_a_server_killed_and_restarted_keeps_every_policys_state(backend: Backend) -> None:
    """Counts, a sliding window's previous count, a gcra bucket's time and a settled debt
    survive the server's crash (PostgreSQL stopped ``-m immediate``, Redis ``kill -9``
    with its AOF): after the restart every hit decides as the reference model, which lost
    nothing, to the bit (on a test clock, so the comparison is exact)."""
    with own_server(backend) as server:
        on = backend.on(server.url)
        clock = on.counter_clock()
        if clock is None:
            pytest.skip(f"{backend.name}: no test clock for its counters")
        try:
            store = await on.store(clock=clock)
            policies = [
                Policy("rl\x1fcrash\x1ffixed\x1fclient:a", "fixed", 10, 60.0, 10),
                Policy("rl\x1fcrash\x1fsliding\x1fclient:a", "sliding", 7, 10.0, 7),
                Policy("rl\x1fcrash\x1fgcra\x1forg:1", "gcra", 4, 8.0, 6),
            ]
            model = Model()

            async def decide(cost: int) -> tuple[Hit, Report]:
                made = hit_on(policies, cost)
                await store.apply([made])
                want = model.hit(policies, cost, clock.monotonic())
                got = report_of(made)
                assert got == want
                return made, want

            first, reported = await decide(2)
            clock.advance(10.5)  # the sliding window rolls: 2 become its previous count
            await decide(1)
            await store.apply([Settle.of(first, 4)])  # a debt of 2 more, in the old window
            model.settle(policies, 2, reported.stamp, clock.monotonic())
            server.stop(**({"kill": True} if backend.name == "redis" else {}))
            server.start()
            assert await served_again(store) < BACK_WITHIN
            clock.advance(1.25)
            made, _ = await decide(1)
            assert made.allowed
            for cost in (1, 1, 1):
                await decide(cost)
        finally:
            await on.close()


async def test_watchers_are_woken_when_the_connection_comes_back(backend: Backend) -> None:
    """A wake-up published while the waiter's connection was down is lost: after a
    reconnect every watched key is woken once, and its waiter claims again; wake-ups
    flow again on the new connection."""
    with own_server(backend) as server:
        on = backend.on(server.url)
        try:
            holder, waiters_store = await on.store(lease=30.0), await on.store()
            mine, later = Claim("rc"), Claim("rc:later")
            await holder.apply([mine, later])
            held = Claim("rc")
            await waiters_store.apply([held])
            assert held.held
            waiters = [Waiter(waiters_store, "rc", held.retry_after) for _ in range(2)]
            server.stop()
            await asyncio.sleep(0.5)  # an outage
            server.start()
            for waiter in waiters:
                await waiter.wait(within=BACK_WITHIN)
            assert waiters_store.claims.reconnects == 1  # type: ignore[attr-defined]
            # Subscribed again: the next release reaches a new watch (30 s lease: no timer).
            found = await applied(waiters_store, lambda: Claim("rc:later"))
            assert found.held
            again = Waiter(waiters_store, "rc:later", found.retry_after)
            await applied(holder, lambda: Release("rc:later", later.token))
            await again.wait(within=BACK_WITHIN)
            assert [w.wakes for w in (*waiters, again)] == [1, 1, 1]
        finally:
            await on.close()


async def applied(store: Store, make: Callable[[], Op]) -> Op:
    """An op applied once the store serves again (its connections come back by themselves)."""
    started = time.monotonic()
    while True:
        op = make()
        try:
            await store.apply([op])
            return op
        except StoreError:
            if time.monotonic() - started > BACK_WITHIN:
                raise
            await asyncio.sleep(0.2)


async def test_what_a_failed_batch_was_ending_lapses_with_its_lease(backend: Backend) -> None:
    """A Release (or Save) and a Vacate whose batch failed are not lost for good: the
    holder stops renewing what they were ending, so the claim and the slot lapse within
    their lease, as SQLite's rollback ends them. (They were renewed for as long as the
    process lived: every retry of that key waited, then 409; the cap stayed one lower.)"""
    with own_server(backend) as server:
        on = backend.on(server.url)
        try:
            holder, other = await on.store(lease=1.0), await on.store(lease=1.0)
            mine = Claim("fb")
            slot = Hit([], [], [], slots=["fb:slot"], caps=[1])
            await holder.apply([mine, slot])
            assert mine.token
            assert slot.allowed
            server.stop()
            with pytest.raises(StoreError):
                await asyncio.wait_for(holder.apply([Release("fb", mine.token)]), 30.0)
            with pytest.raises(StoreError):
                await asyncio.wait_for(holder.apply([Vacate.of(slot)]), 30.0)
            server.start()
            assert await served_again(holder) < BACK_WITHIN
            # Nobody ends them now; the other store gets both once their lease is over (each
            # op through applied: one op served does not say each connection came back).
            started = time.monotonic()

            async def taken(make: Callable[[], Op], took: Callable[[Op], bool]) -> None:
                while not took(await applied(other, make)):
                    assert time.monotonic() - started < 10.0, "still held by a failed batch"
                    await asyncio.sleep(0.2)

            await taken(lambda: Claim("fb"), lambda claim: claim.token > 0)
            await taken(
                lambda: Hit([], [], [], slots=["fb:slot"], caps=[1]), lambda hit: hit.allowed
            )
        finally:
            await on.close()
