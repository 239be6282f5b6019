"""Whose clock counts: a network store decides windows on its server's clock.

Two app hosts whose clocks disagree by hours must still share one window: the
second "host" here is a process whose wall clock libfaketime moves 2 h ahead or
behind. SQLite does not run this: its windows are on the host's monotonic clock
(one host; wall-clock jumps are covered by its unit tests and the gate).
"""

from __future__ import annotations

import glob
import time

import pytest

from porch.store.base import Hit
from support import used

from .conftest import Backend

pytestmark = pytest.mark.anyio


def faketime(offset: str) -> dict[str, str]:
    """Environment moving a process's wall clock by ``offset`` (its monotonic clock too)."""
    # Where Debian/Ubuntu (multiarch) and source installs put it; never a recursive
    # glob over /usr/lib, which takes minutes.
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    found += sorted(glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    found += sorted(glob.glob("/usr/local/lib/faketime/libfaketime.so.1"))
    if not found:
        pytest.skip("libfaketime is not installed")
    return {"LD_PRELOAD": found[0], "FAKETIME": offset}


@pytest.mark.parametrize("offset", ["+2h", "-2h"])
async def test_hosts_with_skewed_clocks_share_one_window(backend: Backend, offset: str) -> None:
    if not backend.leases:
        pytest.skip("SQLite: one host, its monotonic clock (see the module docstring)")
    skewed = await backend.holder("-", env=faketime(offset))
    assert abs(float((await skewed.send("probe-clock"))["now"]) - time.time()) > 3000
    store = await backend.store()
    window = 1.0

    async def here() -> Hit:
        hit = Hit(["skew"], [3], [window])
        await store.apply([hit])
        return hit

    async def there() -> Hit:
        answer = await skewed.send(f"hit skew 3 {window}")
        hit = Hit(["skew"], [3], [window])
        hit.allowed, hit.remaining = answer["allowed"], answer["remaining"]
        hit.next, hit.wall = answer["next"], answer["wall"]
        return hit

    hits = [await here(), await there(), await here(), await there(), await here()]
    assert [(h.allowed, used(h)) for h in hits] == [
        (True, [1]),
        (True, [2]),
        (True, [3]),
        (False, [3]),
        (False, [3]),
    ]
    # The skewed host's decisions carry the server's time, and the same window end.
    for h in hits:
        assert abs(h.wall - time.time()) < 5.0
    ends = [h.wall + h.next[0] for h in hits]
    assert max(ends) - min(ends) < backend.tolerance
    await backend.elapse(max(h.next[0] for h in hits) + 0.2)
    fresh = await there()
    assert (fresh.allowed, used(fresh)) == (True, [1])
    assert used(await here()) == [2]


async def test_the_admin_reads_counters_on_the_clock_they_were_decided_on(
    backend: Backend,
) -> None:
    # A store given a test clock (porch.testing's) decides its counters on it: its admin
    # (porch.counts, porch inspect) must read them on it too, or a live counter would
    # read as long gone (or a gone one as live) once the test moves the clock.
    clock = backend.counter_clock()
    if clock is None:
        pytest.skip(f"{backend.name}: no test clock for its counters")
    store = await backend.store(clock=clock)
    key = "rl\x1fapi\x1f2-per-60s\x1fc1"
    await store.apply([Hit([key], [2], [60.0])])
    opener = store.capabilities.admin
    assert opener is not None
    admin = opener()
    try:
        [counter] = await admin.counters(client="c1")
        assert (counter.rule, counter.limit, counter.count) == ("api", "2-per-60s", 1)
        assert 59.0 < counter.reset_in <= 60.0
        clock.advance(30)
        [counter] = await admin.counters(client="c1")
        assert 29.0 < counter.reset_in <= 30.0
        clock.advance(31)  # the window has ended on the test clock, not on the server's
        assert await admin.counters(client="c1") == []
    finally:
        await admin.close()
