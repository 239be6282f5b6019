"""Idempotent functions on every backend: two pools are two hosts sharing the store.

One execution per key however many calls race on both pools, every duplicate gets
the first result, a call that raises stores nothing, a wait is bounded, a killed
holder's key is taken over, a sync function runs on its pool's own loop, and a call
reserves room for its result before it runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest

from porch import (
    IdempotencyPolicy,
    KeyInProgressError,
    KeyPool,
    KeyReusedError,
    Quota,
    QuotaFullError,
    idempotent_function,
)
from porch.idempotency import IdempotentFunction
from support import until

from .conftest import Backend

pytestmark = pytest.mark.anyio

WITHIN = 20.0  # generous: the machine is loaded


class Counted:
    """An async event handler that counts its runs; each run waits for ``gate`` if set."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.gate: asyncio.Event | None = None
        self.fail = 0

    async def __call__(self, event: dict[str, Any]) -> dict[str, Any]:
        self.runs.append(event["id"])
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the handler failed")
        return {"id": event["id"], "run": len(self.runs)}


def on(
    pool: KeyPool, handler: Counted, **options: Any
) -> IdempotentFunction[[dict[str, Any]], Any]:
    return idempotent_function(pool, key=lambda event: event["id"], name="events", **options)(
        handler
    )


async def test_one_execution_across_two_hosts(backend: Backend) -> None:
    one, other = await backend.pool(), await backend.pool()
    handler = Counted()
    handler.gate = asyncio.Event()
    functions = [on(one, handler), on(other, handler)]
    event = {"id": "evt-1", "amount": 5}
    calls = [asyncio.ensure_future(functions[i % 2](event)) for i in range(10)]
    await until(lambda: handler.runs, "one call runs the handler")
    handler.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*calls), WITHIN)
    assert handler.runs == ["evt-1"]
    assert results == [{"id": "evt-1", "run": 1}] * 10
    # Later deliveries, on either host, get the stored result.
    assert await functions[1](event) == await functions[0](event) == {"id": "evt-1", "run": 1}
    assert handler.runs == ["evt-1"]


async def test_a_failed_call_stores_nothing(backend: Backend) -> None:
    pool = await backend.pool()
    handler = Counted()
    handler.fail = 1
    process = on(pool, handler)
    with pytest.raises(RuntimeError, match="the handler failed"):
        await process({"id": "evt-2"})
    assert await process({"id": "evt-2"}) == {"id": "evt-2", "run": 2}
    assert await process({"id": "evt-2"}) == {"id": "evt-2", "run": 2}
    assert handler.runs == ["evt-2", "evt-2"]


async def test_other_arguments_under_one_key_are_refused(backend: Backend) -> None:
    pool = await backend.pool()
    handler = Counted()
    process = on(pool, handler)
    await process({"id": "evt-3", "amount": 1})
    with pytest.raises(KeyReusedError):
        await process({"id": "evt-3", "amount": 2})
    # With no fingerprint, the key alone decides: the stored result is returned.
    by_key = idempotent_function(pool, key=lambda e: e["id"], name="by-key", fingerprint=None)(
        handler
    )
    assert await by_key({"id": "evt-3", "amount": 1}) == {"id": "evt-3", "run": 2}
    assert await by_key({"id": "evt-3", "amount": 2}) == {"id": "evt-3", "run": 2}
    # A key given at the call is that key (here one the arguments never name).
    given = idempotent_function(pool, name="given", fingerprint=None)(handler)
    first = await given.with_key("job-1")({"id": "a"})
    assert await given.with_key("job-1")({"id": "b"}) == first
    assert handler.runs == ["evt-3", "evt-3", "a"]


async def test_a_duplicate_waits_at_most_wait_timeout(backend: Backend) -> None:
    one, other = await backend.pool(), await backend.pool()
    handler = Counted()
    handler.gate = asyncio.Event()
    owner = asyncio.ensure_future(on(one, handler)({"id": "evt-4"}))
    await until(lambda: handler.runs, "the owner runs")
    for pool, policy in [
        (one, IdempotencyPolicy(wait_timeout=0.2)),
        (other, IdempotencyPolicy(wait_timeout=0.2)),
        (other, IdempotencyPolicy(concurrent="conflict", wait_timeout=3600)),
    ]:
        with pytest.raises(KeyInProgressError):
            await asyncio.wait_for(on(pool, handler, policy=policy)({"id": "evt-4"}), WITHIN)
    handler.gate.set()
    assert await asyncio.wait_for(owner, WITHIN) == {"id": "evt-4", "run": 1}
    assert handler.runs == ["evt-4"]


async def test_a_killed_holders_key_is_taken_over(backend: Backend) -> None:
    """A process holding the function's key dies (kill -9): the key is not wedged."""
    holder = await backend.holder("\x1ffn:events\x1fevt-5", **backend.lease(1.0))
    assert holder.token > 0
    pool = await backend.pool()
    handler = Counted()
    call = asyncio.ensure_future(on(pool, handler)({"id": "evt-5"}))
    # It waits behind the live holder (the handler never runs meanwhile) ...
    await until(lambda: pool.statistics().queued == 0 and not call.done(), "waiting")
    assert handler.runs == []
    os.kill(holder.pid, signal.SIGKILL)
    # ... and runs once the holder is dead.
    assert await asyncio.wait_for(call, WITHIN) == {"id": "evt-5", "run": 1}
    assert handler.runs == ["evt-5"]


async def test_a_sync_function_runs_once_on_its_own_loop(backend: Backend) -> None:
    options: dict[str, Any] = {} if backend.clock is None else {"clock": backend.clock}
    runs: list[int] = []
    started = threading.Event()
    release = threading.Event()

    def charge(order: int, cents: int) -> dict[str, int]:
        runs.append(order)
        started.set()
        release.wait(WITHIN)
        return {"order": order, "charged": cents}

    async def charge_async(order: int, cents: int) -> dict[str, int]:
        return charge(order, cents)  # never runs: it is the duplicate

    sync = idempotent_function(KeyPool(backend.unopened(**options)), key="order")(charge)
    host = await backend.pool()
    other_host = idempotent_function(host, key="order", name=sync.name)(charge_async)
    try:
        first = asyncio.ensure_future(asyncio.to_thread(sync, 7, 500))
        await asyncio.wait_for(asyncio.to_thread(started.wait, WITHIN), WITHIN)
        duplicates = [
            asyncio.ensure_future(asyncio.to_thread(sync, 7, 500)),
            asyncio.ensure_future(other_host(7, 500)),
        ]
        release.set()
        results = await asyncio.wait_for(asyncio.gather(first, *duplicates), WITHIN)
        assert results == [{"order": 7, "charged": 500}] * 3
        assert runs == [7]
        with pytest.raises(KeyReusedError):
            await asyncio.to_thread(sync, 7, 900)
    finally:
        await asyncio.to_thread(sync.close)


async def test_a_call_reserves_room_for_its_result_before_it_runs(backend: Backend) -> None:
    """As a keyed request's claim: a call whose result could not be stored (the quota is
    full of other calls' reservations, on any host) is refused before it runs."""
    one, other = await backend.pool(), await backend.pool()
    policy = IdempotencyPolicy(max_stored=1_000)
    quota = Quota(scope_bytes=1_500, client_bytes=1_500, total_bytes=1 << 20)
    handler = Counted()
    handler.gate = asyncio.Event()
    running = asyncio.ensure_future(on(one, handler, policy=policy, quota=quota)({"id": "r-1"}))
    await until(lambda: handler.runs, "the first call runs")
    second = on(other, handler, policy=policy, quota=quota)
    with pytest.raises(QuotaFullError) as refused:
        await asyncio.wait_for(second({"id": "r-2"}), WITHIN)
    assert refused.value.bucket == "scope"
    assert handler.runs == ["r-1"]  # the refused call never ran
    handler.gate.set()
    assert await asyncio.wait_for(running, WITHIN) == {"id": "r-1", "run": 1}
    # Its small result replaced its reservation: the other call fits now.
    assert await asyncio.wait_for(second({"id": "r-2"}), WITHIN) == {"id": "r-2", "run": 2}
