"""Quotas on every backend (issue 26, finding 1): bytes are capped per caller scope, per
client identity whatever scopes it presents, and in all; a claim reserves its response's
room before its handler runs, so a save within that reservation always fits."""

from __future__ import annotations

import json

import pytest

from porch.store.base import Claim, Lookup, Quota, Release, Save, Store, StoredResponse

from .conftest import Backend

pytestmark = pytest.mark.anyio


def sized(n: int) -> StoredResponse:
    return StoredResponse(b"d", 200, (), b"x" * n)


async def save(store: Store, key: str, n: int, **options: object) -> str:
    op = Save(key, sized(n), 60.0, **options)  # type: ignore[arg-type]
    await store.apply([op])
    return op.outcome


async def claim(store: Store, key: str, **options: object) -> Claim:
    op = Claim(key, **options)  # type: ignore[arg-type]
    await store.apply([op])
    return op


async def test_a_client_cannot_buy_more_room_with_new_credentials(backend: Backend) -> None:
    backend.quotas_across_keys()
    # Catches: each new Cookie was a new scope with its own quota (issue 26, finding 1).
    store = await backend.store()
    quota = Quota(scope_bytes=1000, total_bytes=10_000, client_bytes=150)
    # ~65 bytes each (key, digest, body): two fit the client's 150, whatever the scope.
    outcomes = [
        await save(store, f"c{i}", 60, scope=f"cred:{i}", client="10.0.0.1", quota=quota)
        for i in range(4)
    ]
    assert outcomes == ["saved", "saved", "quota", "quota"]
    assert await save(store, "c9", 60, scope="cred:9", client="10.0.0.2", quota=quota) == "saved"


async def test_a_claim_is_refused_when_its_reservation_does_not_fit(backend: Backend) -> None:
    backend.quotas_across_keys()
    one, other = await backend.store(), await backend.store()
    quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=240)
    mine = {"client": "10.0.0.1", "quota": quota, "reserve": 100}
    first = await claim(one, "r1", scope="cred:a", **mine)
    second = await claim(one, "r2", scope="cred:b", **mine)
    assert (first.token > 0, second.token > 0, first.over, second.over) == (True, True, None, None)
    third = await claim(other, "r3", scope="cred:c", **mine)  # another process, same client
    assert (third.token, third.held, third.stored, third.over) == (0, False, None, "client")
    # Nothing was taken: the key is free for anyone whose quota has room.
    free = await claim(other, "r3", scope="cred:c", client="10.0.0.9", quota=quota, reserve=100)
    assert free.token > 0
    await other.apply([Release("r3", free.token, scope="cred:c", client="10.0.0.9")])
    # A save replaces its reservation by its own size; a release frees it.
    saved = Save("r1", sized(40), 60.0, token=first.token, scope="cred:a", client="10.0.0.1")
    saved.quota = quota
    await one.apply([saved])
    assert saved.outcome == "saved"
    assert (
        await claim(other, "r3", scope="cred:c", **mine)
    ).over == "client"  # 43 + 100 + 100 > 240
    await one.apply([Release("r2", second.token, scope="cred:b", client="10.0.0.1")])
    assert (await claim(other, "r3", scope="cred:c", **mine)).token > 0  # 43 + 100


async def test_each_cap_is_named(backend: Backend) -> None:
    backend.quotas_across_keys()
    store = await backend.store()
    scope_cap = Quota(scope_bytes=150, total_bytes=10_000, client_bytes=10_000)
    total_cap = Quota(scope_bytes=10_000, total_bytes=150, client_bytes=10_000)
    for quota, expected in ((scope_cap, "scope"), (total_cap, "total")):
        tag = expected[0]
        ok = await claim(store, f"{tag}1", scope="s", client="c", quota=quota, reserve=100)
        over = await claim(store, f"{tag}2", scope="s", client="c", quota=quota, reserve=100)
        assert (ok.over, over.over, over.token) == (None, expected, 0)
        await store.apply([Release(f"{tag}1", ok.token, scope="s", client="c")])


async def test_a_save_within_its_reservation_always_fits(backend: Backend) -> None:
    store = await backend.store()
    quota = Quota(scope_bytes=200, total_bytes=200, client_bytes=200)
    taken = await claim(store, "fit", scope="s", client="c", quota=quota, reserve=200)
    assert taken.token > 0  # the reservation fills every cap exactly
    outcome = await save(
        store, "fit", 190, token=taken.token, scope="s", client="c", quota=quota
    )  # 190 + key and digest: just under its 200
    assert outcome == "saved"
    found = Lookup("fit")
    await store.apply([found])
    assert found.result == sized(190)


async def test_a_dead_holders_reservation_is_reclaimed(backend: Backend) -> None:
    backend.quotas_across_keys()
    quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=150)
    reserving = {"scope": "s", "client": "c", "reserve": 100, "quota": [10_000, 10_000, 150]}
    holder = await backend.holder(
        "dead", env={"PORCH_HOLDER_CLAIM": json.dumps(reserving)}, **backend.lease(2.0)
    )  # long enough that a loaded machine's late renewal never lapses it while it lives
    assert holder.token > 0
    store = await backend.store()
    refused = await claim(store, "next", scope="s", client="c", quota=quota, reserve=100)
    assert refused.over == "client"  # the live holder's 100 + 100 > 150
    await holder.kill()
    await backend.elapse(2.5)  # past its lease, where claims have one
    taken = await claim(store, "next", scope="s", client="c", quota=quota, reserve=100)
    assert (taken.over, taken.token > 0) == (None, True)
