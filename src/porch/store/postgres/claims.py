"""What the PostgreSQL store's leases and watches do their own way: LISTEN, one statement.

The engine is shared with the Redis store (:mod:`porch.store._watches`,
:mod:`porch.store._leases`); here is how PostgreSQL does its two parts:

- a wake-up: every :class:`~porch.store.base.Save` and
  :class:`~porch.store.base.Release` sends ``NOTIFY <channel>, md5(key)`` in its
  own transaction, so it leaves exactly when the claim came free. One
  connection per process LISTENs on the channel (:class:`Listen`);
- a renewal: every lease the process holds, extended in one call of the batch
  function (``Renew`` ops), on the heartbeat's own connection (:class:`Renewals`);
  a release at close is one call too, whose NOTIFYs wake the waiters.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..._tasks import stop_if_cancelled
from ...errors import StoreError
from .._leases import CLAIM, HeldLeases, Lease
from ..base import Release
from ..urls import redact
from .codec import Op, Renew, settle

__all__ = ["Listen", "Renewals", "key_hash"]


def key_hash(key: str) -> str:
    """The notification payload for ``key``, as PostgreSQL's md5(convert_to(key, 'UTF8'))."""
    return hashlib.md5(key.encode("utf-8", "surrogatepass"), usedforsecurity=False).hexdigest()


class Listen:
    """The store's :class:`~porch.store._watches.Channel`: one LISTEN connection."""

    name = "the PostgreSQL LISTEN connection"

    def __init__(self, connect: Callable[[], Awaitable[Any]], channel: str, timeout: float) -> None:
        self._connect = connect
        self.channel = channel
        self.timeout = timeout

    async def listen(self, deliver: Callable[[str], None], ready: Callable[[], None]) -> None:
        lost = asyncio.Event()
        conn = await self._connect()
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            async with asyncio.timeout(self.timeout):
                await conn.add_listener(
                    self.channel, lambda _conn, _pid, _channel, payload: deliver(payload)
                )
            # Asked to stop while connecting (a cancel some await lost): never wait on
            # the connection then, or the loop's end waits on this task forever.
            stop_if_cancelled()
            ready()
            await lost.wait()
        finally:  # cancelled too (the store closing, or its loop shutting down)
            if not conn.is_closed():
                conn.terminate()  # never waits on a server that does not answer


class Renewals:
    """The store's :class:`~porch.store._leases.Renewer`: one call per round, its own connection.

    ``connect`` opens a connection; ``call(conn, ops)`` runs the batch function
    over ``ops`` and returns its rows (bounded by the statement timeout).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        call: Callable[[Any, list[Op]], Awaitable[Any]],
        held: HeldLeases,
    ) -> None:
        self._connect = connect
        self._call = call
        self._held = held
        self._conn: Any = None

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        renewals = [Renew(lease.key, lease.token) for lease in _claims(leases)]
        ops: list[Op] = list(renewals)
        await self._run(ops)
        return [renewal.renewed for renewal in renewals]

    async def release(self, leases: Sequence[Lease]) -> None:
        await self._run([Release(lease.key, lease.token) for lease in _claims(leases)])

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                async with asyncio.timeout(1.0):
                    await conn.close()
            except Exception:
                conn.terminate()

    async def _run(self, ops: list[Op]) -> None:
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect()
            rows = await self._call(self._conn, ops)
        except BaseException as exc:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.terminate()  # its state is unknown: the next round reconnects
            if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                raise
            raise StoreError(redact(f"PostgreSQL store: {exc!r}")) from exc
        settle(ops, {}, rows, self._held)


def _claims(leases: Sequence[Lease]) -> Sequence[Lease]:
    for lease in leases:
        if lease.kind != CLAIM:
            raise StoreError(f"the PostgreSQL store cannot renew a {lease.kind!r} lease")
    return leases
