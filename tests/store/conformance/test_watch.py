"""Waiting for a claim held elsewhere, on every backend: woken, never polling.

``claims.watch`` must call ``wake`` once the claim may have come free: its holder
saved or released it, or died (kill -9). The holders here keep long leases, so
a wake within a few seconds comes from the store's notification (lock release,
LISTEN/NOTIFY, pub/sub), not from the lease-end backstop — except for the killed
holder, whose short lease *is* what bounds a dead holder on a lease backend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from porch.store.base import Claim, Release, Save, Store, StoredResponse
from support import spin

from .conftest import Backend

pytestmark = pytest.mark.anyio

LONG_LEASE = 30.0
WOKEN_WITHIN = 5.0  # generous: the machine is loaded


class Phase:
    """The test's current step, which every wake records.

    A wake that comes too early shows in its phase at the end of the test, however
    late it came: no sleep waiting for one to turn up.
    """

    def __init__(self) -> None:
        self.now = "watching"


class Waiter:
    """A watch on one key: an event set by ``wake`` (counted, with the test's phase at
    each wake), and its cancel function."""

    def __init__(
        self, store: Store, key: str, retry_after: float | None, phase: Phase | None = None
    ) -> None:
        self.woken = asyncio.Event()
        self.wakes = 0
        self.phase = phase or Phase()
        self.woken_in: list[str] = []
        self.loop = asyncio.get_running_loop()
        self.on_loop = True
        self.cancel = store.claims.watch(key, self._wake, retry_after)

    def _wake(self) -> None:
        try:
            self.on_loop = self.on_loop and asyncio.get_running_loop() is self.loop
        except RuntimeError:  # called from a thread, not the loop
            self.on_loop = False
        self.wakes += 1
        self.woken_in.append(self.phase.now)
        self.woken.set()

    async def wait(self, within: float = WOKEN_WITHIN) -> None:
        await asyncio.wait_for(self.woken.wait(), within)
        assert self.on_loop, "wake() must be called on the event loop"


async def held_claim(store: Store, key: str) -> Claim:
    op = Claim(key)
    await store.apply([op])
    assert op.held, "the key should be held elsewhere"
    return op


async def test_a_waiter_is_woken_when_the_holder_saves(backend: Backend) -> None:
    owner = await backend.store(**backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    mine = Claim("w:save")
    await owner.apply([mine])
    held = await held_claim(waiters_store, "w:save")
    phase = Phase()
    first = Waiter(waiters_store, "w:save", held.retry_after, phase)
    second = Waiter(waiters_store, "w:save", held.retry_after, phase)
    response = StoredResponse(b"d", 200, (), b"done")
    save = Save("w:save", response, 60.0, token=mine.token)
    phase.now = "saving"
    await owner.apply([save])
    assert save.outcome == "saved"
    await first.wait()
    await second.wait()
    # Nothing woke them before the save (a wake while nothing changed shows here).
    assert set(first.woken_in) == set(second.woken_in) == {"saving"}
    again = Claim("w:save")
    await waiters_store.apply([again])
    assert again.stored == response


async def test_a_waiter_is_woken_when_the_holder_releases(backend: Backend) -> None:
    owner = await backend.store(**backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    mine = Claim("w:rel")
    await owner.apply([mine])
    held = await held_claim(waiters_store, "w:rel")
    waiter = Waiter(waiters_store, "w:rel", held.retry_after)
    release = Release("w:rel", mine.token)
    await owner.apply([release])
    assert release.released
    await waiter.wait()
    again = Claim("w:rel")
    await waiters_store.apply([again])
    assert again.token > mine.token


async def test_a_cancelled_watch_is_not_woken(backend: Backend) -> None:
    owner = await backend.store(**backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    mine = Claim("w:cancel")
    await owner.apply([mine])
    held = await held_claim(waiters_store, "w:cancel")
    cancelled = Waiter(waiters_store, "w:cancel", held.retry_after)
    control = Waiter(waiters_store, "w:cancel", held.retry_after)
    cancelled.cancel()
    await owner.apply([Release("w:cancel", mine.token)])
    await control.wait()
    # The release's one notification wakes every watch of the key together: a wrongly
    # woken cancelled watch would be a few loop turns behind the control, at most.
    await spin()
    assert cancelled.wakes == 0


async def test_a_waiter_is_woken_when_the_holder_process_is_killed(backend: Backend) -> None:
    """kill -9: SQLite's lock dies with the process at once; a lease lapses (1 s here)."""
    holder = await backend.holder("w:killed", **backend.lease(1.0))
    assert holder.token > 0
    waiters_store = await backend.store()
    held = await held_claim(waiters_store, "w:killed")
    waiter = Waiter(waiters_store, "w:killed", held.retry_after)
    waiter.phase.now = "killed"
    os.kill(holder.pid, signal.SIGKILL)
    await waiter.wait()
    assert set(waiter.woken_in) == {"killed"}
    taken = Claim("w:killed")
    await waiters_store.apply([taken])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WOKEN_WITHIN
    # A lease backend may wake a moment early (its timer vs the server's clock): the
    # lease ends within 1 s of the kill, so claim again until then.
    while taken.held and loop.time() < deadline:
        await asyncio.sleep(0.05)
        taken = Claim("w:killed")
        await waiters_store.apply([taken])
    assert (taken.held, taken.token > holder.token) == (False, True)


async def test_waiting_costs_no_cpu_and_another_process_saving_wakes(backend: Backend) -> None:
    holder = await backend.holder("w:idle", **backend.lease(LONG_LEASE))
    waiters_store = await backend.store()
    held = await held_claim(waiters_store, "w:idle")
    waiter = Waiter(waiters_store, "w:idle", held.retry_after)
    # A measurement, not an order: the CPU this process spends over 2 s of waiting
    # (after 0.2 s for the watch's connections and threads to start).
    await asyncio.sleep(0.2)
    cpu = time.process_time()
    await asyncio.sleep(2.0)
    spent = time.process_time() - cpu
    # This process (every thread) spent well under a tenth of the wait: no polling.
    assert spent < 0.2, f"{spent:.3f} s of CPU while waiting 2 s"
    waiter.phase.now = "saving"
    assert await holder.send("save 60 from another process") == {"outcome": "saved"}
    await waiter.wait()
    assert set(waiter.woken_in) == {"saving"}  # waiting all along, not woken early
    again = Claim("w:idle")
    await waiters_store.apply([again])
    assert again.stored is not None
    assert again.stored.body == b"from another process"
