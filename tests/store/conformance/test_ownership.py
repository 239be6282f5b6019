"""Idempotency ownership through the key pool, on every backend: two pools are two hosts.

The pool's ownership calls (Acquire / Complete) over the seam: one owner among
both pools, every waiter answered by the owner's stored response (or a 422
mismatch), a released key handed to the next waiter, a dead holder's key taken
over, and a stale owner's report fenced.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal

import pytest

from porch.idempotency._ownership import OWNER, Acquire, Complete, Mismatch, Outcome, Report
from porch.pool._pool import KeyPool
from porch.store.base import Lookup, StoredResponse
from support import until

from .conftest import Backend

pytestmark = pytest.mark.anyio

DIGEST = b"the request's digest"
ANSWERED_WITHIN = 10.0  # generous: the machine is loaded


def response(body: bytes) -> StoredResponse:
    return StoredResponse(DIGEST, 201, ((b"content-type", b"application/json"),), body)


def acquire(pool: KeyPool, key: str, digest: bytes = DIGEST, wait: float = 20.0) -> Acquire:
    call = Acquire(asyncio.get_running_loop().create_future(), key, digest, wait)
    pool.submit(key, call)
    return call


async def complete(pool: KeyPool, key: str, token: int, answer: StoredResponse | None) -> Report:
    future: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
    pool.submit(key, Complete.of(future, key, token, answer, 60.0), must_deliver=True)
    return await asyncio.wait_for(future, ANSWERED_WITHIN)


async def outcomes(calls: list[Acquire]) -> list[Outcome]:
    return list(await asyncio.wait_for(asyncio.gather(*(c.future for c in calls)), ANSWERED_WITHIN))


class Phases:
    """The test's step (``now``) at which each call was answered.

    A call answered too early shows in its phase at the end of the test, however
    late that wrong answer came: no sleep waiting for one to turn up.
    """

    def __init__(self, calls: list[Acquire]) -> None:
        self.now = "claiming"
        self._at: dict[int, str] = {}
        for call in calls:
            call.future.add_done_callback(functools.partial(self._answered, id(call)))

    def _answered(self, call: int, _: object) -> None:
        self._at[call] = self.now

    def of(self, calls: list[Acquire]) -> set[str | None]:
        return {self._at.get(id(c)) for c in calls}


async def owner_among(calls: list[Acquire]) -> Acquire:
    """Wait until one of ``calls`` owns the key (the test checks that the others waited)."""
    done, _ = await asyncio.wait(
        [c.future for c in calls], timeout=ANSWERED_WITHIN, return_when=asyncio.FIRST_COMPLETED
    )
    assert done, "nobody got the key"
    finished = [c for c in calls if c.future.done()]
    assert len(finished) == 1, [c.future.result() for c in finished]
    owner = finished[0]
    assert owner.future.result() is OWNER
    assert owner.token > 0
    return owner


async def test_one_owner_across_two_pools_and_every_waiter_gets_its_response(
    backend: Backend,
) -> None:
    one, other = await backend.pool(), await backend.pool()
    calls = [acquire(pool, "o:order") for _ in range(5) for pool in (one, other)]
    stranger = acquire(other, "o:order", digest=b"another request")
    phases = Phases([*calls, stranger])
    owner = await owner_among([*calls, stranger])
    owner_pool = one if calls.index(owner) % 2 == 0 else other
    phases.now = "saving"
    assert await complete(owner_pool, "o:order", owner.token, response(b"{}")) == "saved"
    waiters = [c for c in calls if c is not owner]
    assert await outcomes(waiters) == [response(b"{}")] * len(waiters)
    assert await outcomes([stranger]) == [Mismatch(DIGEST)]  # the 422 path
    # One owner: everyone else was answered only once the owner had reported.
    assert phases.of([owner]) == {"claiming"}
    assert phases.of([*waiters, stranger]) == {"saving"}
    # A later duplicate on either pool is answered from the store at once.
    assert (
        await outcomes([acquire(one, "o:order"), acquire(other, "o:order")])
        == [response(b"{}")] * 2
    )


async def test_a_released_key_goes_to_one_of_the_waiters(backend: Backend) -> None:
    """An owner that stores nothing (a 5xx) releases: one waiter owns the key next."""
    one, other = await backend.pool(), await backend.pool()
    calls = [acquire(pool, "o:retry") for _ in range(3) for pool in (one, other)]
    phases = Phases(calls)
    first = await owner_among(calls)
    first_pool = one if calls.index(first) % 2 == 0 else other
    phases.now = "releasing"
    assert await complete(first_pool, "o:retry", first.token, None) == "released"
    rest = [c for c in calls if c is not first]
    second = await owner_among(rest)
    assert second.token > first.token
    second_pool = one if calls.index(second) % 2 == 0 else other
    phases.now = "saving"
    assert await complete(second_pool, "o:retry", second.token, response(b"2")) == "saved"
    waiters = [c for c in rest if c is not second]
    assert await outcomes(waiters) == [response(b"2")] * len(waiters)
    assert phases.of([first]) == {"claiming"}
    assert phases.of([second]) == {"releasing"}
    assert phases.of(waiters) == {"saving"}


async def test_a_killed_holders_key_is_taken_over(backend: Backend) -> None:
    """kill -9 of the holder's process: its claim ends (SQLite at once, a 1 s lease here)."""
    holder = await backend.holder("o:dead", **backend.lease(1.0))
    pool = await backend.pool()
    waiting = acquire(pool, "o:dead")
    phases = Phases([waiting])
    # Its claim found the key held: it waits behind the live holder.
    await until(lambda: waiting.claim is not None and waiting.claim.held, "found held")
    phases.now = "killed"
    os.kill(holder.pid, signal.SIGKILL)
    assert await outcomes([waiting]) == [OWNER]
    assert phases.of([waiting]) == {"killed"}  # never answered while the holder lived
    assert waiting.token > holder.token
    assert await complete(pool, "o:dead", waiting.token, response(b"after")) == "saved"


async def test_a_stale_owners_report_is_fenced(backend: Backend) -> None:
    """An owner whose claim ended (here: released; on a lease backend also a lapsed
    lease) and was taken by a newer owner can never store over it."""
    one, other = await backend.pool(), await backend.pool()
    old = acquire(one, "o:stale")
    assert await outcomes([old]) == [OWNER]
    assert await complete(one, "o:stale", old.token, None) == "released"
    new = acquire(other, "o:stale")
    assert await outcomes([new]) == [OWNER]
    assert new.token > old.token
    assert await complete(one, "o:stale", old.token, response(b"stale")) == "fenced"
    assert await complete(other, "o:stale", new.token, response(b"new")) == "saved"
    assert await complete(one, "o:stale", old.token, response(b"stale")) == "fenced"
    lookup = Lookup("o:stale")
    await one.store.apply([lookup])
    assert lookup.result == response(b"new")
