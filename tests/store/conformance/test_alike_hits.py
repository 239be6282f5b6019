"""A hot client's identical hits in one batch decide as if one by one, for every algorithm
and cost, and its settles in one batch count as if one by one.

The network stores send a batch's alike hits (one rule, one client, one cost)
as one entry with a count (porch/store/alike.py): the server decides how many
fit in turn and answers each limit's state before them; a batch's alike settles
go as one settle of their summed units. Hypothesis draws a rule (one to three
limits over the levels' keys, any algorithms), then batches at moments of a
manual clock, each one to three runs of up to 16 identical hits of one cost or
up to 8 settles of earlier hits (refunds and charges); every hit's verdict and
reports must equal the reference model's, deciding and settling them one by one
in the batch's order, to the bit.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from porch.clock import ManualClock
from porch.store.base import Hit, Settle, Store

from .conftest import Backend, hit_on, one_home, report_of
from .model import Model, Policy, Report

pytestmark = pytest.mark.anyio

LEVELS = ("client:a", "org:1", "")
STEPS = st.sampled_from([0.0, 0.05, 0.3, 0.5, 1.0, 1.3, 2.0, 4.5])
# A batch: the step, then one to three runs, each n alike hits of cost c, or settles
# of earlier batches' hits (from the a-th on) by these deltas.
RUNS = st.one_of(
    st.tuples(st.just("hits"), st.integers(1, 16), st.integers(0, 3)),
    st.tuples(
        st.just("settles"),
        st.integers(0, 1 << 16),
        st.lists(st.integers(-3, 6), min_size=1, max_size=8),
    ),
)
BATCHES = st.lists(
    st.tuples(STEPS, st.lists(RUNS, min_size=1, max_size=3)), min_size=3, max_size=12
)
_EXAMPLES = int(os.environ.get("PORCH_POLICY_EXAMPLES", "0"))
PROFILE = settings(
    max_examples=_EXAMPLES or 40,
    derandomize=not _EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_runs = itertools.count()


@st.composite
def rules(draw: st.DrawFn, algorithms: Sequence[str]) -> list[tuple[int, str, int, float, int]]:
    levels = draw(st.lists(st.sampled_from(range(3)), min_size=1, max_size=3, unique=True))
    limits = []
    for level in levels:
        algorithm = draw(st.sampled_from(algorithms))
        amount = draw(st.integers(1, 8))
        window = draw(st.sampled_from([0.5, 1.0, 1.7]))
        burst = draw(st.integers(1, 9)) if algorithm == "gcra" else amount
        limits.append((level, algorithm, amount, window, burst))
    return limits


async def play(store: Store, clock: ManualClock, drawn: list[Any], batches: list[Any]) -> None:
    run = one_home(
        store, _runs, lambda n: [f"rl\x1falike{n}\x1fl{i}\x1f{lv}" for i, lv in enumerate(LEVELS)]
    )
    policies = [
        Policy(f"rl\x1falike{run}\x1fl{level}\x1f{LEVELS[level]}", algorithm, amount, window, burst)
        for level, algorithm, amount, window, burst in drawn
    ]
    model = Model()
    counted: list[tuple[Hit, Report]] = []
    for dt, runs in batches:
        clock.advance(dt)
        t = clock.monotonic()
        ops: list[Hit | Settle] = []
        expected: list[tuple[Hit, Report, int]] = []
        for kind, a, b in runs:
            if kind == "hits":
                for _ in range(a):
                    hit = hit_on(policies, b)
                    ops.append(hit)
                    expected.append((hit, model.hit(policies, b, t), b))
            elif counted:  # (the model decides in the batch's order, as the store must)
                for i, delta in enumerate(b):
                    hit, report = counted[(a + i) % len(counted)]
                    ops.append(Settle.of(hit, hit.cost + delta))
                    model.settle(policies, delta, report.stamp, t)
        await asyncio.wait_for(store.apply(ops), 30)
        for i, (hit, want, cost) in enumerate(expected):
            got = report_of(hit)
            assert got == want, (i, runs, cost, t, [(p.algorithm, p.amount) for p in policies])
            if hit.allowed:
                counted.append((hit, want))


async def test_alike_hits_in_one_batch_decide_as_one_by_one(backend: Backend) -> None:
    clock = backend.counter_clock()
    if clock is None:
        pytest.skip(f"{backend.name}: no test clock, so no exact comparison (see COUNTER_CLOCKS)")
    store = backend.unopened(clock=clock)
    algorithms = sorted(store.capabilities.algorithms)

    def on_its_own_loop() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(asyncio.wait_for(store.open(), 30))
            try:

                @PROFILE
                @given(drawn=rules(algorithms), batches=BATCHES)
                def check(drawn: list[Any], batches: list[Any]) -> None:
                    loop.run_until_complete(play(store, clock, drawn, batches))

                check()
            finally:
                loop.run_until_complete(asyncio.wait_for(store.close(), 30))
        finally:
            loop.close()

    await asyncio.wait_for(asyncio.to_thread(on_its_own_loop), 600)
