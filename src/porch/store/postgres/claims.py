"""What the PostgreSQL store's leases and watches do their own way: LISTEN, one statement.

The engine is shared with the Redis store (:mod:`porch.store._watches`,
:mod:`porch.store._leases`); here is how PostgreSQL does its two parts:

- a wake-up: every :class:`~porch.store.base.Save` and
  :class:`~porch.store.base.Release` sends ``NOTIFY <channel>, md5(key)`` in its
  own transaction, so it leaves exactly when the claim came free. One
  connection per process LISTENs on the channel (:class:`Listen`);
- a renewal: every lease the process holds, extended in one statement on the
  heartbeat's own connection (:class:`Renewals`): claims by the batch function
  (``Renew`` ops), concurrency slots by ``slot_leases_v1`` (slots.py); a release
  at close is one statement too, whose NOTIFYs wake the claims' waiters.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..._tasks import stop_if_cancelled
from ...errors import StoreError
from .._leases import CLAIM, SLOT, Lease
from ..base import Release
from ..urls import redact
from .codec import Op, Renew

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
    """The store's :class:`~porch.store._leases.Renewer`: one statement per round, on a
    connection of its own, for both kinds of lease: claims through the batch function
    (``Renew``/``Release`` ops), concurrency slots through ``slot_leases_v1``.

    ``connect`` opens a connection; ``call(conn, ops, slots, lease)`` runs one statement
    over the claims' ``ops`` and the ``slots`` (renewed for ``lease`` seconds, or ended
    when it is None) and returns rows ``(kind, number, code)``: kind 0, an op's number
    (its position + 1) and its code; kind 1, a slot's number and 1 if renewed (bounded
    by the statement timeout).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        call: Callable[[Any, list[Op], list[Lease], float | None], Awaitable[Any]],
        lease: float,
    ) -> None:
        self._connect = connect
        self._call = call
        self._lease = lease
        self._conn: Any = None

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        claims = [lease for lease in leases if lease.kind == CLAIM]
        slots = [lease for lease in leases if lease.kind == SLOT]
        _check(leases, len(claims) + len(slots))
        ops: list[Op] = [Renew(lease.key, lease.token) for lease in claims]
        rows = await self._run(ops, slots, self._lease)
        renewed = {(row[0], row[1]) for row in rows if row[2] == 1}
        numbers = {CLAIM: 0, SLOT: 0}
        result: list[bool] = []
        for lease in leases:
            numbers[lease.kind] += 1
            result.append((0 if lease.kind == CLAIM else 1, numbers[lease.kind]) in renewed)
        return result

    async def release(self, leases: Sequence[Lease]) -> None:
        claims = [lease for lease in leases if lease.kind == CLAIM]
        slots = [lease for lease in leases if lease.kind == SLOT]
        _check(leases, len(claims) + len(slots))
        await self._run([Release(lease.key, lease.token) for lease in claims], slots, None)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                async with asyncio.timeout(1.0):
                    await conn.close()
            except Exception:
                conn.terminate()

    async def _run(self, ops: list[Op], slots: list[Lease], lease: float | None) -> Any:
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect()
            return await self._call(self._conn, ops, slots, lease)
        except BaseException as exc:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.terminate()  # its state is unknown: the next round reconnects
            if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                raise
            raise StoreError(redact(f"PostgreSQL store: {exc!r}")) from exc


def _check(leases: Sequence[Lease], known: int) -> None:
    if known != len(leases):
        kinds = sorted({lease.kind for lease in leases} - {CLAIM, SLOT})
        raise StoreError(f"the PostgreSQL store cannot renew a {kinds[0]!r} lease")
