"""The operator's admin protocol, on every backend: closed, it leaves nothing open."""

from __future__ import annotations

import gc
import warnings

import pytest

from .conftest import Backend

pytestmark = pytest.mark.anyio


async def test_a_closed_admin_leaves_no_connection_to_the_collector(backend: Backend) -> None:
    store = await backend.store()
    make = store.capabilities.admin
    assert make is not None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        admin = make()
        assert await admin.counters(client="10.0.0.1") == []  # connected
        await admin.close()
        del admin
        gc.collect()
    # Redis's admin once closed its client but not the pool under it (issue 24): the
    # connection warned when collected, in whichever test ran then.
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
