"""Idempotency claims, on every backend: one owner, fence tokens, stored answers, releases."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from porch.store.base import Claim, Lookup, Release, Save, Store, StoredResponse

from .conftest import Backend

pytestmark = pytest.mark.anyio


def response(body: bytes) -> StoredResponse:
    return StoredResponse(b"digest", 201, ((b"content-type", b"text/plain"),), body)


async def claim(store: Store, key: str) -> Claim:
    op = Claim(key)
    await store.apply([op])
    return op


async def save(store: Store, key: str, body: bytes, token: int) -> str:
    op = Save(key, response(body), 60.0, token=token)
    await store.apply([op])
    return op.outcome


async def release(store: Store, key: str, token: int) -> bool:
    op = Release(key, token)
    await store.apply([op])
    return op.released


async def lookup(store: Store, key: str) -> StoredResponse | None:
    op = Lookup(key)
    await store.apply([op])
    return op.result


def assert_held(backend: Backend, op: Claim, lease: float) -> None:
    assert (op.held, op.token, op.stored) == (True, 0, None)
    if backend.leases:
        # Seconds until the holder's lease ends, on the server's clock.
        assert op.retry_after is not None
        assert 0 < op.retry_after <= lease + backend.tolerance
    else:
        assert op.retry_after is None  # SQLite's claims die with their holder, no lease


async def test_one_owner_among_two_stores_claiming_at_once(backend: Backend) -> None:
    one, other = await backend.store(), await backend.store()
    for i in range(10):
        key = f"race:{i}"
        first, second = await asyncio.gather(claim(one, key), claim(other, key))
        winners = [op for op in (first, second) if op.token > 0]
        losers = [op for op in (first, second) if op.held]
        assert (len(winners), len(losers)) == (1, 1), (first.token, second.token)
        assert winners[0].stored is None
        assert not winners[0].held


async def test_a_claim_held_elsewhere_is_reported_held(backend: Backend) -> None:
    lease = 3.0
    owner, other = await backend.store(**backend.lease(lease)), await backend.store()
    mine = await claim(owner, "held")
    assert (mine.token > 0, mine.held, mine.stored) == (True, False, None)
    assert_held(backend, await claim(other, "held"), lease)
    # Still held: asking again changes nothing.
    assert_held(backend, await claim(other, "held"), lease)


async def test_tokens_increase_strictly_per_key(backend: Backend) -> None:
    stores = [await backend.store(), await backend.store()]
    tokens = []
    for round_ in range(6):
        store = stores[round_ % 2]
        op = await claim(store, "fence")
        assert op.token > 0
        tokens.append(op.token)
        assert await release(store, "fence", op.token)
    assert tokens == sorted(set(tokens)), tokens


async def test_a_saved_response_is_returned_instead_of_a_claim(backend: Backend) -> None:
    owner, other = await backend.store(), await backend.store()
    mine = await claim(owner, "saved")
    assert await save(owner, "saved", b"first", mine.token) == "saved"
    for store in (other, owner):
        again = await claim(store, "saved")
        assert (again.stored, again.token, again.held) == (response(b"first"), 0, False)


async def test_release_frees_the_key_and_a_stale_release_frees_nothing(backend: Backend) -> None:
    lease = 3.0
    owner, other = await backend.store(**backend.lease(lease)), await backend.store()
    mine = await claim(owner, "rel")
    assert_held(backend, await claim(other, "rel"), lease)
    assert await release(owner, "rel", mine.token)
    theirs = await claim(other, "rel")
    assert (theirs.token > mine.token, theirs.held) == (True, False)
    # The old token is not the key's claim any more.
    assert not await release(owner, "rel", mine.token)
    assert_held(backend, await claim(owner, "rel"), 3.0)
    assert await release(other, "rel", theirs.token)


async def test_a_live_holder_keeps_its_claim_and_close_ends_it(backend: Backend) -> None:
    """A lease is renewed by the holder's store while it lives (heartbeat), past several
    lease lengths; closing the store ends its claims. SQLite: the lock lives as long as
    its holder, whatever the time, and dies with the store's lock file."""
    # A lease a loaded machine's late heartbeat cannot lapse (0.6 s did, under load).
    lease = 1.5
    owner, other = await backend.store(**backend.lease(lease)), await backend.store()
    mine = await claim(owner, "alive")
    await backend.elapse(3600.0 if backend.clock is not None else 2.5 * lease)
    assert_held(backend, await claim(other, "alive"), lease)
    await backend.close_store(owner)
    theirs = await claim(other, "alive")
    assert (theirs.token > mine.token, theirs.held) == (True, False)


async def test_a_stale_token_never_overwrites_a_newer_owners_response(backend: Backend) -> None:
    """A Save or Release with a token that is no longer the key's claim is fenced.

    On SQLite no time frees a claim (its lock lives as long as its holder), so a
    stale token only exists after its own holder ended the claim, as here: it is
    fenced all the same. The lease backends also fence an owner whose lease
    lapsed (test_a_frozen_holder_whose_lease_lapsed_is_fenced_when_it_wakes).
    """
    old_store, new_store = await backend.store(), await backend.store()
    old = await claim(old_store, "stale")
    assert await release(old_store, "stale", old.token)
    new = await claim(new_store, "stale")
    assert new.token > old.token
    # The new owner has not saved yet: the stale one may not store in its place.
    assert await save(old_store, "stale", b"stale", old.token) == "fenced"
    assert await lookup(new_store, "stale") is None
    assert_held(backend, await claim(old_store, "stale"), 3.0)
    assert await save(new_store, "stale", b"newer", new.token) == "saved"
    assert await save(old_store, "stale", b"stale", old.token) == "fenced"
    assert await lookup(old_store, "stale") == response(b"newer")


async def test_a_frozen_holder_whose_lease_lapsed_is_fenced_when_it_wakes(
    backend: Backend,
) -> None:
    """The holder process is SIGSTOPped (its heartbeat stops with it) until its lease
    ends; another store takes the key over and saves. The holder, thawed, is fenced.
    SQLite has no lease: a frozen holder keeps its lock, so nobody can take over."""
    lease = 0.5
    holder = await backend.holder("frozen", **backend.lease(lease))
    assert holder.token > 0
    other = await backend.store()
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        await backend.elapse(3600.0 if backend.clock is not None else lease + 0.7)
        taken = await claim(other, "frozen")
        if not backend.leases:
            assert_held(backend, taken, lease)
            return
        assert (taken.held, taken.token > holder.token) == (False, True)
        assert await save(other, "frozen", b"taken over", taken.token) == "saved"
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert await holder.send("save 60 from the frozen holder") == {"outcome": "fenced"}
    assert await lookup(other, "frozen") == response(b"taken over")
