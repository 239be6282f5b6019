"""Counters, on every backend: all limits or none, refusals free, exact windows, exact counts."""

from __future__ import annotations

import asyncio
import time

import pytest

from porch.store.base import Hit, Store
from support import HitCall, used

from .conftest import Backend

pytestmark = pytest.mark.anyio


async def hit(store: Store, keys: list[str], amounts: list[int], windows: list[float]) -> Hit:
    h = Hit(keys, amounts, windows)
    await store.apply([h])
    return h


async def test_a_limit_counts_to_its_amount_then_refuses(backend: Backend) -> None:
    store = await backend.store()
    verdicts = [await hit(store, ["one"], [3], [60.0]) for _ in range(5)]
    assert [(h.allowed, used(h)) for h in verdicts] == [
        (True, [1]),
        (True, [2]),
        (True, [3]),
        (False, [3]),
        (False, [3]),
    ]


async def test_hits_in_one_batch_count_in_order(backend: Backend) -> None:
    store = await backend.store()
    hits = [Hit(["batch"], [10], [60.0]) for _ in range(14)]
    await store.apply(hits)
    assert [h.allowed for h in hits] == [True] * 10 + [False] * 4
    assert [used(h)[0] for h in hits] == [*range(1, 11), 10, 10, 10, 10]


async def test_a_batch_mixing_clients_and_rules_decides_each_hit_in_turn(backend: Backend) -> None:
    store = await backend.store()
    pair = (backend.together(store, "m:short", "m:long"), [3, 5], [60.0, 60.0])
    other = (["m:other"], [2], [60.0])
    hits = [Hit(*shape) for shape in (pair, other, pair, pair, other, other, pair, pair)]
    await store.apply(hits)
    assert [(h.allowed, used(h)) for h in hits] == [
        (True, [1, 1]),
        (True, [1]),
        (True, [2, 2]),
        (True, [3, 3]),
        (True, [2]),
        (False, [2]),
        (False, [3, 3]),
        (False, [3, 3]),
    ]
    # (end - now) of a fresh window is 60 up to a rounding error of the clock's magnitude.
    assert all(0 < r <= 60.0 + 1e-6 for h in hits for r in h.next)
    # One counter under two amounts in one batch (a rule changed between hosts).
    # The count goes 2, 3, 3, 3, 4, 5: what remains is each hit's amount less it.
    mixed = [Hit(["m:other"], [n], [60.0]) for n in (3, 2, 3, 4, 7)]
    await store.apply(mixed)
    assert [(h.allowed, h.remaining) for h in mixed] == [
        (True, [0]),
        (False, [0]),
        (False, [0]),
        (True, [0]),
        (True, [2]),
    ]


async def test_several_limits_are_all_or_nothing_and_a_refusal_consumes_nothing(
    backend: Backend,
) -> None:
    store = await backend.store()
    keys, amounts = backend.together(store, "c:short", "c:long"), [2, 3]
    short = 0.5  # a real half second on a server's clock
    windows = [short, 60.0]
    first = await hit(store, keys, amounts, windows)
    second = await hit(store, keys, amounts, windows)
    # The short limit refuses: the long one must not count it either.
    third = await hit(store, keys, amounts, windows)
    assert [(h.allowed, used(h)) for h in (first, second, third)] == [
        (True, [1, 1]),
        (True, [2, 2]),
        (False, [2, 2]),
    ]
    await backend.elapse(short + 0.2)
    fourth = await hit(store, keys, amounts, windows)
    # The long limit refuses now: the fresh short window must not count it.
    fifth = await hit(store, keys, amounts, windows)
    assert [(h.allowed, used(h)) for h in (fourth, fifth)] == [(True, [1, 3]), (False, [1, 3])]
    # Other rules sharing one of the keys see exactly what was consumed.
    alone = await hit(store, [keys[1]], [4], [60.0])
    assert (alone.allowed, used(alone)) == (True, [4])


async def test_a_window_starts_at_the_first_hit_and_resets_when_it_ends(
    backend: Backend,
) -> None:
    store = await backend.store()
    window, tol = 1.0, backend.tolerance
    first = await hit(store, ["w"], [5], [window])
    assert first.allowed
    assert used(first) == [1]
    assert window - tol <= first.next[0] <= window + 1e-6
    # The wall time is the decision's: the ManualClock's, or the server's (this host).
    expected_wall = backend.clock.wall() if backend.clock is not None else time.time()
    assert first.wall == pytest.approx(expected_wall, abs=2.0 if backend.leases else 1e-9)

    await backend.elapse(0.4)
    second = await hit(store, ["w"], [5], [window])
    assert used(second) == [2]
    assert second.next[0] < first.next[0]
    assert second.next[0] == pytest.approx(first.next[0] - 0.4, abs=tol)
    assert second.wall >= first.wall

    await backend.elapse(second.next[0] + 0.15)
    third = await hit(store, ["w"], [5], [window])
    assert (third.allowed, used(third)) == (True, [1])  # a fresh window
    assert window - tol <= third.next[0] <= window + 1e-6


async def test_keys_and_windows_are_independent(backend: Backend) -> None:
    store = await backend.store()
    a = Hit(["ind:a"], [1], [60.0])
    b = Hit(["ind:b"], [1], [60.0])
    again = Hit(["ind:a"], [1], [60.0])
    await store.apply([a, b, again])
    assert (a.allowed, b.allowed, again.allowed) == (True, True, False)


async def test_counts_are_exact_under_concurrent_callers_from_two_pools(backend: Backend) -> None:
    """Two pools over two store instances on the same data: like two processes or hosts."""
    limit, per_pool = 250, 200
    pools = [await backend.pool() for _ in range(2)]
    calls = []
    for _ in range(per_pool):
        for pool in pools:
            call = HitCall(Hit(["crowd", f"crowd:{id(pool)}"], [limit, 10_000], [60.0, 60.0]))
            pool.submit("crowd", call)
            calls.append(call)
    hits: list[Hit] = await asyncio.wait_for(asyncio.gather(*(c.future for c in calls)), 60)
    allowed = [h for h in hits if h.allowed]
    assert len(allowed) == limit
    # Every allowed hit saw its own count: nothing was counted twice or lost.
    assert sorted(used(h)[0] for h in allowed) == list(range(1, limit + 1))
    assert all(used(h)[0] == limit for h in hits if not h.allowed)
    # Each pool's own counter took exactly its allowed hits.
    for pool in pools:
        mine = [h for h in allowed if h.keys[1] == f"crowd:{id(pool)}"]
        assert sorted(used(h)[1] for h in mine) == list(range(1, len(mine) + 1))
    after = await hit(pools[0].store, ["crowd"], [limit], [60.0])
    assert (after.allowed, used(after)) == (False, [limit])
