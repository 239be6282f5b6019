"""The lease heartbeat's own behaviour (porch.store._leases), on a real Redis store.

What every lease backend must do with its claims is proven in the conformance
suite (tests/store/conformance/test_leases.py: a blocked loop keeps them, close
ends them, also after the loop ended). Here: what the heartbeat says about a
blocked event loop, which is the same code for PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import redis

from porch.store._leases import CLAIM, Lease, Renewer
from porch.store.base import Claim
from porch.store.redis import RedisStore
from support import until, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

# Half of it, the warning's threshold, is longer than the stall a loaded machine gives a
# test's loop between two awaits, and the heartbeat thread (a renewal every 0.5 s) is
# late by a whole lease only if starved for a second.
LEASE = 1.5


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    prefix = f"porch-l{uuid.uuid4().hex[:10]}"
    owner, other = (RedisStore(redis_url, prefix=prefix, lease=LEASE) for _ in range(2))
    await owner.open()
    await other.open()
    try:
        yield owner, other
    finally:
        await owner.close()
        await other.close()


def _blocked_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "event loop has run nothing" in r.getMessage()
    ]


async def test_a_loop_blocked_past_half_a_lease_is_warned_once_and_the_claim_kept(
    stores: tuple[RedisStore, RedisStore], caplog: pytest.LogCaptureFixture, redis_url: str
) -> None:
    owner, other = stores
    caplog.set_level(logging.INFO, logger="porch.store")
    mine = Claim("s\x1fblocked")
    await owner.apply([mine])
    record = owner.names.record(mine.key)
    server = redis.Redis.from_url(redis_url)

    def lease_end() -> bytes | None:
        """The claim's lease end on the server: each renewal of the heartbeat moves it."""
        return server.hget(record, "l")  # type: ignore[return-value]

    def renewed(since: bytes | None) -> bool:
        return lease_end() != since

    try:
        # A renewal with the loop answering first: a stall of the loop before this point
        # (a loaded machine) is over, and said over, before the block begins.
        await until(functools.partial(renewed, lease_end()), "a renewal")
        await until(lambda: not _blocked_warnings(caplog) or "runs again" in caplog.text)
        caplog.clear()
        # The block: this loop (the owner's) runs nothing until the heartbeat warned,
        # then for two more of its rounds, which find it still blocked and say nothing.
        wait_until(lambda: _blocked_warnings(caplog), "the blocked-loop warning")
        for _ in range(2):
            wait_until(functools.partial(renewed, lease_end()), "a renewal while blocked")
        assert len(_blocked_warnings(caplog)) == 1, caplog.text
    finally:
        server.close()
    theirs = Claim(mine.key)
    await other.apply([theirs])
    assert theirs.held  # kept from the heartbeat thread meanwhile
    # Once the loop runs again, that is said too (at INFO): the episode is over.
    await until(lambda: "event loop runs again" in caplog.text, "the loop said to run again")


class Relay:
    """A TCP relay on loopback to ``port``. ``stall()``: the connections open by then stop
    passing bytes (held, as on a lost network path) until ``close()``; later ones pass."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = 0
        self.open: list[asyncio.Event] = []  # each connection's: set while it stalls
        self.released = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def stall(self) -> None:
        for stalled in self.open:
            stalled.set()

    async def close(self) -> None:
        self.released.set()
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()
            await asyncio.wait_for(self.server.wait_closed(), 10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_writer]
        stalled = asyncio.Event()
        self.open.append(stalled)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if stalled.is_set():
                        await self.released.wait()
                        return
                    sink.write(data)
                    await sink.drain()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_a_renewal_that_stops_answering_does_not_lapse_the_claims(redis_url: str) -> None:
    # Catches: a heartbeat whose next round waits for the one still out, which may take its
    # whole deadline (connect and round trip: 8 s by default): one connection that stops
    # answering lapsed every lease of the process, and a duplicate elsewhere ran again.
    target = urllib.parse.urlsplit(redis_url)
    assert target.port is not None
    relay = Relay(target.port)
    await relay.start()
    prefix = f"porch-l{uuid.uuid4().hex[:10]}"
    through = target._replace(netloc=f"127.0.0.1:{relay.port}").geturl()
    owner = RedisStore(through, prefix=prefix, lease=LEASE)
    other = RedisStore(redis_url, prefix=prefix, lease=LEASE)
    server = redis.Redis.from_url(redis_url)
    try:
        await owner.open()
        await other.open()
        mine = Claim("s\x1fstalled")
        await owner.apply([mine])
        assert mine.token > 0
        record = owner.names.record(mine.key)
        since = server.hget(record, "l")
        await until(lambda: server.hget(record, "l") != since, "a renewal")  # its connection
        relay.stall()  # the heartbeat's connection, and the store's own
        loop = asyncio.get_running_loop()
        stalled, checks = loop.time(), 0
        while loop.time() - stalled < 2.5 * LEASE:  # renewed on the stalled one: lapsed
            theirs = Claim(mine.key)
            await other.apply([theirs])
            taken = f"taken over {loop.time() - stalled:.1f} s into the stall"
            assert (theirs.held, theirs.token) == (True, 0), taken
            checks += 1
            await asyncio.sleep(0.2)
        assert checks >= 5
    finally:
        server.close()
        await relay.close()
        await owner.close()
        await other.close()


class HeldRenewals:
    """A store's own renewer whose renewals wait until ``gate`` is set (``asked`` once one
    does); releases and closes pass."""

    def __init__(self, inner: Renewer, gate: threading.Event, asked: threading.Event) -> None:
        self.inner, self.gate, self.asked = inner, gate, asked

    async def renew(self, leases: Sequence[Lease]) -> Sequence[bool]:
        self.asked.set()
        # Set from the test's loop, another thread: polled here, on the heartbeat's.
        while not self.gate.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return await self.inner.renew(leases)

    async def release(self, leases: Sequence[Lease]) -> None:
        await self.inner.release(leases)

    async def close(self) -> None:
        await self.inner.close()


async def test_close_releases_the_leases_while_a_confirm_is_out(redis_url: str) -> None:
    # Catches: a close that found no renewer free (the only one renewing a late claim,
    # confirm_late) and failed, releasing nothing: the claims stayed to their lease's end.
    prefix = f"porch-l{uuid.uuid4().hex[:10]}"
    owner = RedisStore(redis_url, prefix=prefix, lease=30.0)  # no renewal round meanwhile
    other = RedisStore(redis_url, prefix=prefix, lease=30.0)
    gate, asked = threading.Event(), threading.Event()
    renewals = owner._renewals
    owner._renewals = lambda: HeldRenewals(renewals(), gate, asked)  # type: ignore[method-assign]
    await owner.open()
    await other.open()
    try:
        mine = Claim("s\x1fconfirming")
        await owner.apply([mine])
        heartbeat = owner._heartbeat
        assert heartbeat is not None
        confirming = asyncio.ensure_future(heartbeat.confirm([Lease(CLAIM, mine.key, mine.token)]))
        await until(asked.is_set, "the confirm's renewal asked")
        await owner.close()
        theirs = Claim(mine.key)
        await other.apply([theirs])
        assert theirs.token > 0  # released at close, not held to the end of its lease
        assert await asyncio.wait_for(confirming, 10) == [False]  # ended with its loop
    finally:
        gate.set()
        await owner.close()
        await other.close()
