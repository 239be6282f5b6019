"""Stored responses, on every backend: what was saved comes back byte for byte, until its TTL."""

from __future__ import annotations

import pytest

from porch.store.base import Claim, Lookup, Quota, Save, Store, StoredResponse

from .conftest import Backend

pytestmark = pytest.mark.anyio

RESPONSE = StoredResponse(
    digest=bytes(range(32)),  # a binary digest: compared byte for byte on the 422 path
    status=201,
    headers=((b"content-type", b"application/json"), (b"location", b"/orders/7\xe9")),
    body=b'{"id": 7}\x00\xff\xfe binary tail',
)


async def lookup(store: Store, key: str) -> StoredResponse | None:
    op = Lookup(key)
    await store.apply([op])
    return op.result


async def save(store: Store, key: str, response: StoredResponse, ttl: float, **kw: object) -> str:
    op = Save(key, response, ttl, **kw)  # type: ignore[arg-type]
    await store.apply([op])
    return op.outcome


async def test_a_saved_response_comes_back_exactly_to_any_store(backend: Backend) -> None:
    one, other = await backend.store(), await backend.store()
    assert await lookup(one, "r:missing") is None
    assert await save(one, "r:k", RESPONSE, 60.0) == "saved"
    for store in (one, other):
        found = await lookup(store, "r:k")
        assert found == RESPONSE
        assert found is not None
        assert found.digest == RESPONSE.digest  # the 422 path compares it
    empty = StoredResponse(b"d", 204, (), b"")
    assert await save(one, "r:empty", empty, 60.0) == "saved"
    assert await lookup(other, "r:empty") == empty


async def test_a_stored_response_expires_after_its_ttl(backend: Backend) -> None:
    store = await backend.store()
    assert await save(store, "ttl:short", RESPONSE, 0.5) == "saved"
    assert await save(store, "ttl:long", RESPONSE, 60.0) == "saved"
    assert await lookup(store, "ttl:short") == RESPONSE
    await backend.elapse(0.8)
    assert await lookup(store, "ttl:short") is None
    assert await lookup(store, "ttl:long") == RESPONSE
    # An expired key is free again: claimable, not answered from the old response.
    claim = Claim("ttl:short")
    await store.apply([claim])
    assert (claim.token > 0, claim.stored, claim.held) == (True, None, False)


def sized(n: int) -> StoredResponse:
    return StoredResponse(b"d", 200, (), b"x" * n)


async def test_a_scope_over_its_quota_stores_nothing(backend: Backend) -> None:
    backend.quotas_across_keys()
    """60-byte bodies under a 100-byte scope cap: one fits (whatever the per-row overhead
    up to 40 bytes), two never do."""
    store = await backend.store()
    quota = Quota(scope_bytes=100, total_bytes=10_000)
    assert await save(store, "q:a", sized(60), 60.0, scope="alice", quota=quota) == "saved"
    assert await save(store, "q:b", sized(60), 60.0, scope="alice", quota=quota) == "quota"
    assert await lookup(store, "q:b") is None
    # Another scope has its own allowance.
    assert await save(store, "q:c", sized(60), 60.0, scope="bob", quota=quota) == "saved"
    assert await lookup(store, "q:a") == sized(60)


async def test_the_store_over_its_total_quota_stores_nothing(backend: Backend) -> None:
    backend.quotas_across_keys()
    store = await backend.store()
    quota = Quota(scope_bytes=1000, total_bytes=150)
    assert await save(store, "t:a", sized(60), 60.0, scope="s1", quota=quota) == "saved"
    assert await save(store, "t:b", sized(60), 60.0, scope="s2", quota=quota) == "saved"
    assert await save(store, "t:c", sized(60), 60.0, scope="s3", quota=quota) == "quota"
    assert await lookup(store, "t:c") is None


async def test_quotas_count_live_bytes_only(backend: Backend) -> None:
    backend.quotas_across_keys()
    store = await backend.store()
    quota = Quota(scope_bytes=100, total_bytes=150)
    assert await save(store, "live:a", sized(60), 0.5, scope="s", quota=quota) == "saved"
    assert await save(store, "live:b", sized(60), 0.5, scope="s", quota=quota) == "quota"
    await backend.elapse(0.8)
    # The first response expired: its bytes no longer count, for the scope or the total.
    assert await save(store, "live:b", sized(60), 60.0, scope="s", quota=quota) == "saved"
    assert await save(store, "live:c", sized(60), 60.0, scope="t", quota=quota) == "saved"


async def test_a_save_over_quota_ends_the_claim(backend: Backend) -> None:
    owner, other = await backend.store(), await backend.store()
    claim = Claim("q:claimed")
    await owner.apply([claim])
    assert claim.token > 0
    outcome = await save(
        owner, "q:claimed", sized(500), 60.0, token=claim.token, scope="s", quota=Quota(100, 100)
    )
    assert outcome == "quota"
    again = Claim("q:claimed")
    await other.apply([again])
    assert (again.held, again.stored, again.token > claim.token) == (False, None, True)
