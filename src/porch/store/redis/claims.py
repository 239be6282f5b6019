"""What the Redis store's leases and watches do their own way: pub/sub, one pipeline.

The engine is shared with the PostgreSQL store (:mod:`porch.store._watches`,
:mod:`porch.store._leases`); here is how Redis does its two parts:

- a wake-up: the Save and Release scripts ``PUBLISH`` the logical key on the
  store's channel (only when a Claim found it held: uncontended keys cost no
  message). One connection per process is subscribed (:class:`Subscription`);
- a renewal: every lease the process holds, extended by the ``renew`` script
  (claims) or the ``slot_lease`` script (concurrency slots), all in one pipeline
  on the heartbeat's own client (:class:`Renewals`); a release at close is one
  pipeline of ``release`` scripts, which publish, and ``slot_lease`` ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..._tasks import stop_if_cancelled
from ...errors import StoreError
from .._leases import CLAIM, SLOT, Lease
from .commands import Command, publish, wake
from .keys import KeyNames

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["Renewals", "Subscription"]

# Closing the subscription never waits longer on a server that does not answer.
_CLOSE_TIMEOUT = 1.0


class Subscription:
    """The store's :class:`~porch.store._watches.Channel`: one pub/sub subscription.

    ``client``: a client of its own (one connection), set before the listener starts.
    """

    name = "the Redis wake-up channel"

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.client: Redis | None = None

    async def listen(self, deliver: Callable[[str], None], ready: Callable[[], None]) -> None:
        if self.client is None:
            raise StoreError("the Redis store is not open")
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            # A cancel that redis-py lost (Python 3.11's wait_for, in its send path) still
            # ends this before it waits on the channel again: see porch._tasks.
            stop_if_cancelled()
            async for message in pubsub.listen():
                stop_if_cancelled()
                kind = message["type"]
                if kind == "message":
                    deliver(bytes(message["data"]).decode("utf-8", "surrogatepass"))
                elif kind == "subscribe":  # the first time, and after each resubscription
                    ready()
        finally:  # cancelled too
            # Already broken, perhaps: nothing is left to close cleanly then.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]


class Renewals:
    """The store's :class:`~porch.store._leases.Renewer`: one pipeline per round.

    ``connect()`` makes the heartbeat's own client; ``execute(client, commands)``
    sends commands as one pipeline and checks every reply (StoreError).
    """

    def __init__(
        self,
        connect: Callable[[], Redis],
        execute: Callable[[Redis, list[Command]], Awaitable[list[Any]]],
        close: Callable[[Redis], Awaitable[None]],
        names: KeyNames,
        lease_ms: int,
    ) -> None:
        self._connect = connect
        self._execute = execute
        self._close = close
        self._names = names
        self._lease_ms = lease_ms
        self._client: Redis | None = None

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        names, lease_ms = self._names, self._lease_ms
        results = await self._run(
            [
                ("renew", [names.record(lease.key)], [str(lease.token), lease_ms])
                if lease.kind == CLAIM
                else ("slot_lease", [names.slot(lease.key)], [str(lease.token), lease_ms])
                for lease in _known(leases)
            ]
        )
        return [result == 1 for result in results]

    async def release(self, leases: Sequence[Lease]) -> None:
        names = self._names
        await self._run(
            [
                release_one(names, lease.key, lease.token)
                if lease.kind == CLAIM
                else ("slot_lease", [names.slot(lease.key)], [str(lease.token), 0])
                for lease in _known(leases)
            ]
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await self._close(client)

    async def _run(self, commands: list[Command]) -> list[Any]:
        if self._client is None:
            self._client = self._connect()
        return await self._execute(self._client, commands)


def release_one(names: KeyNames, key: str, token: int) -> Command:
    """A release of a claim at close: its record (its reservation lapses with its lease)."""
    return ("release", [names.record(key)], [str(token), *wake(names, key), publish(names)])


def _known(leases: Sequence[Lease]) -> Sequence[Lease]:
    for lease in leases:
        if lease.kind != CLAIM and lease.kind != SLOT:
            raise StoreError(f"the Redis store cannot renew a {lease.kind!r} lease")
    return leases
