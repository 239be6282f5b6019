"""The store's secret, on every backend: created once with the schema, the same for every
process and host sharing the store, kept across reopening (issue 26, finding 4)."""

from __future__ import annotations

import pytest

from porch.errors import StoreError

from .conftest import Backend

pytestmark = pytest.mark.anyio


async def test_one_secret_for_everyone_sharing_the_store(backend: Backend) -> None:
    one, other = await backend.store(), await backend.store()
    secret = one.secret
    assert isinstance(secret, bytes)
    assert len(secret) == 32
    assert len(set(secret)) > 8  # random bytes, not a constant
    assert other.secret == secret
    await backend.close_store(one)
    await backend.close_store(other)
    again = await backend.store()  # a restart: the same secret, never a new one
    assert again.secret == secret


async def test_no_secret_before_the_store_is_open(backend: Backend) -> None:
    store = backend.unopened()
    with pytest.raises(StoreError, match="not open"):
        _ = store.secret
