"""What keeps a claim alive and what ends it, on every backend: the owner's process, not its loop.

A claim lives as long as its owner's process: renewed by the store while the
process lives (a lease backend's heartbeat, from outside the event loop), ended
at once by ``close()``, and ended within one lease when the process is killed
or frozen (tests/store/conformance/test_claims.py, test_watch.py). SQLite's
claims are locks of the holder's process: the same promises, without a lease.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from porch.store.base import Claim, Release, Store

from .conftest import Backend
from .test_claims import assert_held, claim
from .test_watch import WOKEN_WITHIN, Waiter, held_claim

pytestmark = pytest.mark.anyio

LONG_LEASE = 30.0  # a wake within seconds is then never the lease-end backstop


async def test_an_owner_whose_event_loop_is_blocked_keeps_its_claim(backend: Backend) -> None:
    """Synchronous work in an ``async def`` handler blocks the owner's event loop for
    several leases: its claim stays held all along, and its save lands afterwards."""
    lease, block = 1.0, 3.5
    holder = await backend.holder("blocked", **backend.lease(lease))
    other = await backend.store()
    assert await holder.send(f"block {block}") == {"blocking": True}
    loop = asyncio.get_running_loop()
    started = loop.time()
    checks = 0
    # Past two leases after the block began (the last renewal before it is at most a
    # third of a lease older): a lease renewed only on the blocked loop has lapsed.
    while loop.time() - started < block - 0.5:
        assert_held(backend, await claim(other, "blocked"), lease)
        checks += 1
        await asyncio.sleep(0.2)
    assert checks >= 5
    assert await holder.read() == {"blocked": True}
    assert await holder.send("save 60 after the block") == {"outcome": "saved"}
    replay = await claim(other, "blocked")
    assert replay.stored is not None
    assert replay.stored.body == b"after the block"


@pytest.mark.parametrize("taken_over", [True, False], ids=["taken-over", "not-taken"])
async def test_a_claim_whose_reply_is_read_after_its_lease_ended_runs_once(
    backend: Backend, taken_over: bool
) -> None:
    """The owner's loop is blocked (a handler's synchronous work) while its claim's reply
    waits, and reads it 2.5 leases late: the lease lapsed unrenewed, since the heartbeat
    renews only what is held. Taken over meanwhile, the late claim is given up (both ran
    the handler); if not, it is kept."""
    if not backend.leases:
        pytest.skip("SQLite's claims are locks of their holder's process: no lease to lapse")
    lease = 1.0
    env = {"PORCH_HOLDER_LATE_REPLY": str(2.5 * lease)}
    holder = await backend.holder("-", env=env, **backend.lease(lease))
    other = await backend.store()
    assert await holder.send("claim late") == {"late": True}  # granted; read late
    loop = asyncio.get_running_loop()
    started = loop.time()
    if taken_over:
        while not (await claim(other, "late")).token:
            assert loop.time() - started < 10.0, "the unrenewed lease never lapsed"
            await asyncio.sleep(0.1)
        assert (await holder.read())["token"] == 0  # given up: held elsewhere
    else:
        assert (await holder.read())["token"] > 0  # renewed when read: nobody took it
        assert_held(backend, await claim(other, "late"), lease)


async def test_close_ends_the_claims_at_once_and_wakes_their_waiters(backend: Backend) -> None:
    """A process that leaves (SIGTERM: its store closes) ends its claims there and then,
    long before a lease would lapse: waiters elsewhere are woken and take over."""
    owner = await backend.store(**backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    keys = [f"close:{i}" for i in range(3)]
    mine = [Claim(key) for key in keys]
    await owner.apply(mine)
    waiters = []
    for key in keys:
        held = await held_claim(waiters_store, key)
        waiters.append(Waiter(waiters_store, key, held.retry_after))
    await backend.close_store(owner)
    for waiter in waiters:
        await waiter.wait()
    taken = [Claim(key) for key in keys]
    await waiters_store.apply(taken)
    assert [(t.held, t.token > m.token) for t, m in zip(taken, mine, strict=True)] == [
        (False, True)
    ] * 3


async def test_a_wake_up_that_arrives_before_its_watch_is_not_lost(backend: Backend) -> None:
    """The claim that found the key held and the holder's release can cross: the
    release's wake-up reaches this process before the waiter watches. The watch still
    wakes at once (not at the holder's lease end, 30 s away)."""
    owner = await backend.store(**backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    early, marker = Claim("x:early"), Claim("x:marker")
    await owner.apply([early, marker])
    held = await held_claim(waiters_store, "x:early")
    await held_claim(waiters_store, "x:marker")
    # Wake-ups reach a process in the order they were sent: once the marker's has
    # arrived, so has the earlier one, with nobody watching its key yet.
    marker_waiter = Waiter(waiters_store, "x:marker", held.retry_after)
    await owner.apply([Release("x:early", early.token)])
    await owner.apply([Release("x:marker", marker.token)])
    await marker_waiter.wait()
    late = Waiter(waiters_store, "x:early", held.retry_after)
    await late.wait(within=WOKEN_WITHIN)
    again = Claim("x:early")
    await waiters_store.apply([again])
    assert (again.held, again.token > early.token) == (False, True)


async def test_a_watch_without_a_lease_end_still_wakes_when_its_holder_dies(
    backend: Backend,
) -> None:
    """``retry_after=None`` (no lease end known): a missed wake is not allowed, so a
    lease backend's backstop is one whole lease; a dead holder sends no wake-up."""
    holder = await backend.holder("x:none", **backend.lease(1.0))
    waiters_store: Store = await backend.store()
    await held_claim(waiters_store, "x:none")
    waiter = Waiter(waiters_store, "x:none", None)
    os.kill(holder.pid, signal.SIGKILL)
    await waiter.wait(within=1.0 + WOKEN_WITHIN)
    assert waiter.wakes == 1


@pytest.mark.parametrize("ended", ["closed", "stopped"])
async def test_close_after_the_stores_loop_ended_still_ends_its_claims(
    backend: Backend, ended: str
) -> None:
    """The key pool follows its event loop: a store opened on a loop that has ended is
    closed from the next loop. That loop was closed after its tasks were cancelled
    (``asyncio.run``, a TestClient request's), or only stopped with its tasks pending
    (``run_until_complete`` returned). Either way close() waits on nothing of it, ends
    in bounded time, and still ends the store's claims at once (30 s before their
    lease would)."""
    store = backend.to_open(**backend.lease(LONG_LEASE))
    mine = Claim("moved")

    async def open_and_claim() -> None:
        await store.open()
        await store.apply([mine])

    first = asyncio.new_event_loop()
    try:
        if ended == "closed":
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, open_and_claim()), 20)
        else:
            await asyncio.wait_for(
                asyncio.to_thread(first.run_until_complete, open_and_claim()), 20
            )
        assert mine.token > 0
        await asyncio.wait_for(store.close(), 10)
        taken = await claim(await backend.store(), "moved")
        assert (taken.held, taken.token > mine.token) == (False, True)
    finally:
        # The stopped loop's tasks were cancelled by close(): let them finish, then close it.
        pending = asyncio.all_tasks(first)
        if pending:
            await asyncio.wait_for(
                asyncio.to_thread(first.run_until_complete, asyncio.wait(pending, timeout=10)),
                20,
            )
        first.close()
