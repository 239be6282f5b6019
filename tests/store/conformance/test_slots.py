"""Concurrency slots, on every backend: a cap on requests in flight, all or nothing with
the rate limits, shared by every process and host, and freed when a holder dies — at once
where the holder's lock dies with it (SQLite), within the lease where a heartbeat renews
it (PostgreSQL, Redis)."""

from __future__ import annotations

import asyncio
import time

import pytest

from porch.store.base import Hit, Store, Vacate
from support import used

from .conftest import Backend

pytestmark = pytest.mark.anyio


def slot(key: str, cap: int) -> Hit:
    """A request of a rule whose one limit is a concurrency cap."""
    return Hit([], [], [], slots=[key], caps=[cap])


async def take(store: Store, key: str, cap: int) -> Hit:
    hit = slot(key, cap)
    await store.apply([hit])
    return hit


async def vacate(store: Store, *hits: Hit) -> None:
    await store.apply([Vacate.of(hit) for hit in hits])


async def slotted(backend: Backend, **options: object) -> Store:
    store = await backend.store(**options)
    if not store.capabilities.slots:
        pytest.skip(f"the {backend.name} store takes no concurrency slots yet")
    return store


async def test_a_cap_lets_that_many_in_and_the_next_waits_for_a_vacate(backend: Backend) -> None:
    store = await slotted(backend)
    first, second, third = [await take(store, "cap", 2) for _ in range(3)]
    assert [(h.allowed, h.in_flight) for h in (first, second, third)] == [
        (True, [1]),
        (True, [2]),
        (False, [2]),
    ]
    assert min(first.token, second.token) > 0
    assert first.token != second.token
    assert third.token == 0
    await vacate(store, first)
    fourth = await take(store, "cap", 2)
    assert (fourth.allowed, fourth.in_flight) == (True, [2])
    await vacate(store, second, fourth)
    assert (await take(store, "cap", 2)).in_flight == [1]


async def test_a_vacate_frees_its_slots_once(backend: Backend) -> None:
    store = await slotted(backend)
    first, second = await take(store, "once", 2), await take(store, "once", 2)
    await vacate(store, first)
    await vacate(store, first)  # again: second's slot stays taken
    await store.apply([Vacate(["once"], 0)])  # a refused hit's token frees nothing
    check = await take(store, "once", 2)
    assert (check.allowed, check.in_flight) == (True, [2])
    await vacate(store, second, check)


async def test_slots_are_all_or_nothing_with_the_rate_limits(backend: Backend) -> None:
    store = await slotted(backend)

    def request() -> Hit:
        return Hit(["r:rate"], [3], [60.0], slots=["r:slot"], caps=[1])

    first = request()
    await store.apply([first])
    # No slot: refused, and its rate limit counted nothing.
    second = request()
    await store.apply([second])
    assert (first.allowed, used(first), first.in_flight) == (True, [1], [1])
    assert (second.allowed, used(second), second.in_flight) == (False, [1], [1])
    assert list(second.fits) == [True]  # the rate limit had room: the slot refused it
    await vacate(store, first)
    for _ in range(2):
        ok = request()
        await store.apply([ok])
        assert ok.allowed
        await vacate(store, ok)
    # The rate limit refuses: no slot is taken, so a slot-only request still finds it free.
    over = request()
    await store.apply([over])
    assert (over.allowed, used(over), list(over.fits), over.in_flight, over.token) == (
        False,
        [3],
        [False],
        [0],
        0,
    )
    alone = await take(store, "r:slot", 1)
    assert (alone.allowed, alone.in_flight) == (True, [1])


async def test_several_slot_keys_are_taken_all_or_nothing(backend: Backend) -> None:
    store = await slotted(backend)
    narrow, wide_key = backend.together(store, "s:narrow", "s:wide")

    def both() -> Hit:
        return Hit([], [], [], slots=[narrow, wide_key], caps=[1, 3])

    first = both()
    await store.apply([first])
    second = both()  # narrow is full: wide must not be taken either
    await store.apply([second])
    assert (first.allowed, first.in_flight) == (True, [1, 1])
    assert (second.allowed, second.in_flight) == (False, [1, 1])
    wide = [await take(store, wide_key, 3) for _ in range(3)]
    assert [h.allowed for h in wide] == [True, True, False]
    await vacate(store, first)
    third = both()  # narrow is free, wide full (two slot-only requests and nobody else)
    await store.apply([third])
    assert (third.allowed, third.in_flight) == (True, [1, 3])


async def test_hits_and_vacates_in_one_batch_count_in_order(backend: Backend) -> None:
    store = await slotted(backend)
    hits = [slot("b", 3) for _ in range(5)]
    await store.apply(hits)
    assert [(h.allowed, h.in_flight) for h in hits] == [
        (True, [1]),
        (True, [2]),
        (True, [3]),
        (False, [3]),
        (False, [3]),
    ]
    assert len({h.token for h in hits[:3]}) == 3
    # A vacate before a hit in one batch frees the slot that hit takes.
    after = slot("b", 3)
    refused = slot("b", 3)
    await store.apply([Vacate.of(hits[0]), after, refused])
    assert (after.allowed, after.in_flight) == (True, [3])
    assert (refused.allowed, refused.in_flight) == (False, [3])


async def test_every_store_on_the_data_shares_the_cap(backend: Backend) -> None:
    here = await slotted(backend)
    there = await backend.store()
    mine = [await take(here, "shared", 2) for _ in range(2)]
    theirs = await take(there, "shared", 2)
    assert [h.allowed for h in mine] == [True, True]
    assert (theirs.allowed, theirs.in_flight) == (False, [2])
    await vacate(here, mine[0])
    theirs = await take(there, "shared", 2)
    assert (theirs.allowed, theirs.in_flight) == (True, [2])


async def test_concurrent_requests_from_two_stores_never_pass_the_cap(backend: Backend) -> None:
    """Two stores (processes, hosts) race for 3 slots, 40 requests each, holding a slot for
    a moment: the count in flight, kept by the requests themselves, never passes 3."""
    stores = [await slotted(backend), await backend.store()]
    cap, in_flight, most, passed = 3, 0, 0, 0

    async def request(store: Store) -> None:
        nonlocal in_flight, most, passed
        hit = await take(store, "race", cap)
        if not hit.allowed:
            return
        in_flight += 1
        most = max(most, in_flight)
        passed += 1
        await asyncio.sleep(0.01)  # the handler
        in_flight -= 1
        await vacate(store, hit)

    await asyncio.gather(*(request(stores[i % 2]) for i in range(80)))
    assert most == cap
    assert passed >= cap
    # Everything was vacated: the cap is whole again.
    assert (await take(stores[0], "race", cap)).in_flight == [1]


async def test_a_closed_store_frees_its_slots_at_once(backend: Backend) -> None:
    other = await slotted(backend)
    holder = await backend.holder("-")
    assert (await holder.send("slot gone 1"))["allowed"] is True
    assert (await take(other, "gone", 1)).allowed is False
    await holder.send("exit")  # its store closes: the slot is free now, not at a lease's end
    check = await take(other, "gone", 1)
    assert (check.allowed, check.in_flight) == (True, [1])


async def test_a_killed_holder_frees_its_slots_at_once_or_within_its_lease(
    backend: Backend,
) -> None:
    lease = 1.0
    other = await slotted(backend, **backend.lease(lease))
    holder = await backend.holder("-", **backend.lease(lease))
    for _ in range(2):
        assert (await holder.send("slot killed 3"))["allowed"] is True
    check = await take(other, "killed", 3)
    assert check.in_flight == [3]
    await vacate(other, check)
    holder.process.kill()
    await holder.process.wait()
    died = time.monotonic()
    free: list[float] = []

    async def probe() -> bool:
        hit = await take(other, "killed", 3)
        if hit.allowed:
            await vacate(other, hit)
        if hit.in_flight == [1]:  # the dead holder's two are gone
            free.append(time.monotonic() - died)
            return True
        return False

    while not await probe():
        assert time.monotonic() - died < 10.0, "the dead holder's slots never came back"
        await asyncio.sleep(0.05)
    bound = other.capabilities.slot_lease
    if bound is None:
        assert free[0] < 0.5, f"freed {free[0]:.2f} s after the kill, not at once"
    else:
        assert bound == pytest.approx(lease)
        assert free[0] <= bound + 0.5, f"freed {free[0]:.2f} s after the kill (lease {bound})"


async def test_slots_outlive_the_lease_while_their_holder_lives(backend: Backend) -> None:
    # A lease a loaded machine's late heartbeat cannot lapse (0.6 s did, on the cluster).
    lease = 1.5
    store = await slotted(backend, **backend.lease(lease))
    other = await backend.store(**backend.lease(lease))
    held = await take(store, "kept", 1)
    assert held.allowed
    loop = asyncio.get_running_loop()
    started, checks = loop.time(), 0
    # Leases on end: renewed by the heartbeat all along (SQLite: held by a lock, no lease).
    while loop.time() - started < 2.5 * lease:
        assert (await take(other, "kept", 1)).allowed is False
        checks += 1
        await asyncio.sleep(0.1)
    assert checks >= 5
    await vacate(store, held)
    assert (await take(other, "kept", 1)).allowed is True
