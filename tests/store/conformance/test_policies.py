"""The policies on every backend, against the spec's reference model (model.py), to the bit.

Hypothesis draws rules (one to three limits each, over a few counter keys shared
between rules: a client's, another client's, an organisation's, everyone's),
and a run of batches at moments a manual clock is moved to: hits of random
costs (0 included, and above the amount) and settles of earlier allowed hits
by random actual costs, now and then after a restart (the store closed and
another opened on the same data). Each batch is one ``apply`` (one transaction), and
every hit's verdict, fits, remaining, next, full, retry and stamp must equal
the model's exactly. A backend runs it for the algorithms its store declares
(``Capabilities.algorithms``), and only with a test clock: a store decides at
``clock.monotonic()`` when given one (SQLite's injected clock; a network store
named in conftest's COUNTER_CLOCKS sends it with each batch), since a server's
own clock cannot be matched to the bit. ``PORCH_POLICY_EXAMPLES`` sets how many
runs each case draws (random ones then, not the fixed sequence the suite replays).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from porch.clock import ManualClock
from porch.store.base import Algorithm, Hit, Settle, Store, StoreOp

from .conftest import Backend, hit_on, one_home, report_of
from .model import Model, Policy, Report

pytestmark = pytest.mark.anyio

# The levels a rule's limits count under: two clients, their organisation, everyone.
LEVELS = ("client:a", "client:b", "org:1", "")
WINDOWS = (0.3, 0.5, 1.0, 1.7, 2.5)
# Moves of the clock: nothing, window edges, and anything in between.
STEPS = st.one_of(
    st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.5, 1.0, 1.7, 2.5, 5.0]),
    st.floats(min_value=0.0, max_value=3.0, allow_nan=False, allow_infinity=False),
)
ACTIONS = st.one_of(
    st.tuples(st.just("hit"), st.integers(0, 2), st.integers(0, 4)),
    st.tuples(st.just("settle"), st.integers(0, 1 << 16), st.integers(0, 7)),
)


def runs(restart_every: int) -> st.SearchStrategy[list[tuple[float, Any, bool]]]:
    """Batches of actions after moves of the clock; before one in ``restart_every`` (drawn)
    the store is closed and another opened on the same data (a restart)."""
    restarts = st.sampled_from([False] * (restart_every - 1) + [True])
    return st.lists(
        st.tuples(STEPS, st.lists(ACTIONS, min_size=1, max_size=3), restarts),
        min_size=4,
        max_size=30,
    )


# A Redis Cluster store's open costs ~0.2 s (redis-py reads the command table, the wake
# channels are subscribed on every primary): restarts there made its four legs five
# minutes of a loaded run, nine tenths of it opening stores. What a restart proves is
# the server's state, which every other leg proves ten times as often.
RESTART_EVERY = {"redis-cluster": 40}

_EXAMPLES = int(os.environ.get("PORCH_POLICY_EXAMPLES", "0"))
PROFILE = settings(
    max_examples=_EXAMPLES or 100,
    derandomize=not _EXAMPLES,  # the suite replays one sequence; deeper runs explore
    deadline=None,  # a loaded machine's batches are slow; the runs' size bounds the time
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_runs = itertools.count()


@st.composite
def rules(draw: st.DrawFn, algorithms: Sequence[str]) -> list[list[tuple[int, str, int, int]]]:
    """One to three rules: per limit its level, algorithm, amount and burst."""
    drawn: list[list[tuple[int, str, int, int]]] = []
    for _ in range(draw(st.integers(1, 3))):
        levels = draw(
            st.lists(st.sampled_from(range(len(LEVELS))), min_size=1, max_size=3, unique=True)
        )
        limits: list[tuple[int, str, int, int]] = []
        for level in levels:
            algorithm = draw(st.sampled_from(algorithms))
            amount = draw(st.integers(1, 5))
            burst = draw(st.integers(1, 6)) if algorithm == "gcra" else amount
            limits.append((level, algorithm, amount, burst))
        drawn.append(limits)
    return drawn


class Run:
    """One drawn run against a store: its rules as policies, and the hits it may settle."""

    def __init__(
        self, store: Store, clock: ManualClock, windows: list[float], drawn: list[Any]
    ) -> None:
        self.store = store
        self.clock = clock
        run = one_home(
            store,
            _runs,
            lambda n: [f"rl\x1fpolicies{n}\x1fl{i}\x1f{lv}" for i, lv in enumerate(LEVELS)],
        )
        # A key space of its own per run, so the runs of one store never meet.
        self.rules = [
            [
                Policy(
                    f"rl\x1fpolicies{run}\x1fl{level}\x1f{LEVELS[level]}",
                    algorithm,
                    amount,
                    windows[level],
                    burst,
                )
                for level, algorithm, amount, burst in limits
            ]
            for limits in drawn
        ]
        self.model = Model()
        self.allowed: list[tuple[list[Policy], int, Hit, Report]] = []

    async def batch(self, step: int, dt: float, actions: list[tuple[str, int, int]]) -> None:
        self.clock.advance(dt)
        t = self.clock.monotonic()  # the moment the store decides at
        ops: list[StoreOp] = []
        expected: list[tuple[Hit, Report, list[Policy], int]] = []
        for kind, which, amount in actions:
            if kind == "hit":
                policies = self.rules[which % len(self.rules)]
                hit = hit_on(policies, amount)
                ops.append(hit)
                expected.append((hit, self.model.hit(policies, amount, t), policies, amount))
            elif self.allowed:
                policies, cost, earlier, reported = self.allowed[which % len(self.allowed)]
                delta = amount - cost
                algorithms: list[Algorithm] = [p.algorithm for p in policies]  # type: ignore[misc]
                ops.append(
                    Settle(
                        earlier.keys,
                        earlier.amounts,
                        earlier.windows,
                        [delta] * len(policies),
                        earlier.stamp,
                        algorithms,
                        earlier.bursts,
                    )
                )
                self.model.settle(policies, delta, reported.stamp, t)
        await asyncio.wait_for(self.store.apply(ops), 30)
        for hit, want, policies, cost in expected:
            got = report_of(hit)
            assert got == want, (step, t, [(p.key[-9:], p.algorithm) for p in policies], cost)
            if hit.allowed:
                self.allowed.append((policies, cost, hit, want))


class Stores:
    """The store a run plays on, opened on this thread's own loop; another on the same
    data after a restart."""

    def __init__(self, backend: Backend, clock: ManualClock) -> None:
        self.backend = backend
        self.clock = clock
        self.store: Store | None = None

    async def open(self) -> Store:
        store = self.backend.unopened(clock=self.clock)
        await asyncio.wait_for(store.open(), 30)
        self.store = store
        return store

    async def restart(self) -> Store:
        await self.close()
        return await self.open()

    async def close(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.wait_for(store.close(), 30)


def explore(loop: asyncio.AbstractEventLoop, stores: Stores, algorithms: Sequence[str]) -> None:
    """Draw runs and play each on a store of ``stores``, on ``loop`` (this thread's own)."""

    @PROFILE
    @given(
        windows=st.lists(st.sampled_from(WINDOWS), min_size=len(LEVELS), max_size=len(LEVELS)),
        drawn=rules(algorithms),
        steps=runs(RESTART_EVERY.get(stores.backend.name, 10)),
    )
    def check(windows: list[float], drawn: list[Any], steps: list[Any]) -> None:
        assert stores.store is not None
        run = Run(stores.store, stores.clock, windows, drawn)

        async def play() -> None:
            for i, (dt, actions, restart) in enumerate(steps):
                if restart:  # every counter and bucket as it was committed
                    run.store = await stores.restart()
                await run.batch(i, dt, actions)

        loop.run_until_complete(play())

    check()


@pytest.mark.parametrize("policy", ["fixed", "sliding", "gcra", "mixed"])
async def test_every_report_equals_the_reference_model(backend: Backend, policy: str) -> None:
    clock = backend.counter_clock()
    if clock is None:
        pytest.skip(f"{backend.name}: no test clock, so no exact comparison (see COUNTER_CLOCKS)")
    offered = sorted(backend.unopened(clock=clock).capabilities.algorithms)
    if policy == "mixed":
        if len(offered) < 2:
            pytest.skip(f"{backend.name} decides only {offered}")
        algorithms = offered
    elif policy not in offered:
        pytest.skip(f"{backend.name} does not decide {policy} (yet)")
    else:
        algorithms = [policy]

    stores = Stores(backend, clock)

    def on_its_own_loop() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(stores.open())
            try:
                explore(loop, stores, algorithms)
            finally:
                loop.run_until_complete(stores.close())
        finally:
            loop.close()

    # Hypothesis drives a synchronous function: it runs on a thread with an event loop of
    # its own, and this test's loop waits for it.
    await asyncio.wait_for(asyncio.to_thread(on_its_own_loop), 600)


@pytest.mark.parametrize("algorithm", ["fixed", "sliding", "gcra"])
async def test_a_process_killed_after_its_hits_loses_no_counter_or_bucket(
    backend: Backend, algorithm: Algorithm
) -> None:
    store = await backend.store()
    if algorithm not in store.capabilities.algorithms:
        pytest.skip(f"{backend.name} does not decide {algorithm} (yet)")
    holder = await backend.holder("-")
    answers = [await holder.send(f"hit kept 4 3600 {algorithm} 4") for _ in range(5)]
    assert [a["allowed"] for a in answers] == [True] * 4 + [False]
    await holder.kill()  # -9: every answered hit was committed before its answer
    if backend.clock is not None:  # the holder decided on the system clock: catch up
        backend.clock.advance(max(0.0, time.monotonic() - backend.clock.monotonic()))
    algorithms: list[Algorithm] = [algorithm]
    here = Hit(["kept"], [4], [3600.0], algorithms, [4])
    await store.apply([here])
    # An hour's window, a bucket refilling one unit in 900 s: nothing has come back.
    assert (here.allowed, list(here.remaining)) == (False, [0])
    assert here.retry[0] > 800
