"""Claims on PostgreSQL are leases: renewed by heartbeat, bounded when the holder dies or freezes.

The holder is a real process (holder.py). kill -9 and SIGSTOP both stop its
heartbeat; the key must come free about one lease after its last renewal, and
a holder that wakes up afterwards is fenced. A live holder keeps its claim
for as long as it runs (many leases), and close() frees its claims at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from porch.store.base import Claim, Save, StoredResponse
from porch.store.postgres import PostgresStore

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

HOLDER = Path(__file__).with_name("holder.py")
LEASE = 1.5
SLACK = 4.0  # a loaded machine


class Holder:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 30)
        assert line, "the holder exited"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def send(self, line: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        return await self.read()

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.process.pid, sig)


@pytest.fixture
async def holder(postgres_url: str, schema: str) -> AsyncIterator[Holder]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(HOLDER), postgres_url, schema, str(LEASE), "key",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    holder = Holder(process)
    try:
        yield holder
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            await process.wait()


@pytest.fixture
async def store(postgres_url: str, schema: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(postgres_url, schema=schema, lease=LEASE)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def _claim(store: PostgresStore, key: str = "key") -> Claim:
    claim = Claim(key)
    await store.apply([claim])
    return claim


async def _taken_over(store: PostgresStore, within: float) -> tuple[Claim, float]:
    started = time.monotonic()
    while True:
        claim = await _claim(store)
        if not claim.held:
            return claim, time.monotonic() - started
        assert claim.retry_after is not None
        assert claim.retry_after <= LEASE + 0.1  # the wait is bounded by one lease
        assert time.monotonic() - started < within, "the dead holder's claim never came free"
        # Wait as a waiter does: until the holder's lease ends (or a notification).
        woken = asyncio.Event()
        cancel = store.claims.watch("key", woken.set, claim.retry_after)
        try:
            await asyncio.wait_for(woken.wait(), within)
        finally:
            cancel()


async def test_a_live_holder_keeps_its_claim_for_many_leases(
    holder: Holder, store: PostgresStore
) -> None:
    first = await holder.read()
    assert first["token"] > 0
    for _ in range(4):  # 4 x LEASE/1.5: past two full leases
        await asyncio.sleep(LEASE / 1.5)
        assert (await _claim(store)).held
    assert (await holder.send("save done")) == {"outcome": "saved"}
    claim = await _claim(store)
    assert claim.stored is not None
    assert claim.stored.body == b"done"


async def test_a_killed_holder_frees_its_key_within_a_lease(
    holder: Holder, store: PostgresStore
) -> None:
    first = await holder.read()
    holder.signal(signal.SIGKILL)
    claim, waited = await _taken_over(store, LEASE + SLACK)
    assert claim.token > first["token"]
    assert waited < LEASE + SLACK


async def test_a_frozen_holder_is_taken_over_and_fenced_when_it_wakes(
    holder: Holder, store: PostgresStore
) -> None:
    first = await holder.read()
    holder.signal(signal.SIGSTOP)
    claim, _ = await _taken_over(store, LEASE + SLACK)
    assert claim.token > first["token"]
    ours = StoredResponse(b"d", 201, (), b"the new owner's")
    save = Save("key", ours, 60.0, token=claim.token)
    await store.apply([save])
    assert save.outcome == "saved"
    holder.signal(signal.SIGCONT)
    # The woken holder finishes and tries to store its response: refused.
    assert (await holder.send("save stale")) == {"outcome": "fenced"}
    replay = await _claim(store)
    assert replay.stored == ours


async def test_close_ends_this_process_claims_at_once(postgres_url: str, schema: str) -> None:
    a = PostgresStore(postgres_url, schema=schema, lease=30.0)
    b = PostgresStore(postgres_url, schema=schema, lease=30.0)
    await a.open()
    await b.open()
    try:
        first = await _claim(a)
        assert a.held() == {"key": first.token}
        waiting = await _claim(b)
        assert waiting.held
        woken = asyncio.Event()
        b.claims.watch("key", woken.set, waiting.retry_after)
        await a.close()  # notifies: b is woken long before the 30 s lease
        await asyncio.wait_for(woken.wait(), 10)
        assert (await _claim(b)).token > first.token
    finally:
        await a.close()
        await b.close()
