"""Bodies in parts (the store's :class:`~porch.store.base.PartStore`): migration 5's tables.

A body streamed here is a row of ``bodies`` (its id, its key, when it may be
deleted: ``expires``, in the server's time) and one row of ``parts`` per part
(deleted with it: ``ON DELETE CASCADE``). Each part written moves ``expires`` to
``grace`` seconds later, so a body no record will name (its owner died mid-stream)
goes ``grace`` after its newest part; :meth:`PostgresParts.keep` moves it past the
response's TTL just before the Save that names it, so a body outlives its record.
Expired bodies are deleted a few at a time by the processes that write parts.

Parts move on connections of their own (at most ``size`` at once, opened when first
needed), never on the batch workers': a megabyte part would hold a batch of
decisions behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import StoreError
from ..base import Parts
from ..urls import redact

__all__ = ["PART_BYTES", "PostgresParts"]

logger = logging.getLogger("porch.store.postgres")

PART_BYTES = 1 << 20
# A kept body outlives its record's TTL by this much (the Save that names it is sent
# right after, and a batch answers within its statement timeout).
_KEPT_MARGIN = 300.0
# Expired bodies deleted per sweep, and how often one process sweeps at most.
_SWEEP_ROWS = 16
_SWEEP_EVERY = 60.0

_NOW = "extract(epoch FROM clock_timestamp())"


class PostgresParts:
    """Parts of streamed bodies, in ``schema``'s ``bodies`` and ``parts`` tables."""

    part_bytes = PART_BYTES

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        schema: str,
        *,
        grace: float,
        deadline: float,
        size: int = 2,
    ) -> None:
        self._connect = connect
        self.grace = grace
        self._deadline = deadline
        self._size = size
        self._idle: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._open = False
        self._swept = float("-inf")
        s = schema
        # A part's body row is made by its first part (or found, for this key only) and
        # its expiry moved on by every part: one statement per part.
        self._write = (
            f"WITH b AS (INSERT INTO {s}.bodies AS x (id, key, expires)"
            f" VALUES ($1, $2, {_NOW} + $5)"
            " ON CONFLICT (id) DO UPDATE SET expires = excluded.expires"
            " WHERE x.key = excluded.key RETURNING x.id)"
            f" INSERT INTO {s}.parts (body, seq, data) SELECT b.id, $3, $4 FROM b"
            " ON CONFLICT (body, seq) DO UPDATE SET data = excluded.data"
        )
        self._keep = (
            f"UPDATE {s}.bodies b SET expires = {_NOW} + $3 WHERE b.id = $1 AND b.key = $2"
            " AND (SELECT count(*) = $4 AND coalesce(sum(octet_length(p.data)), 0) = $5"
            f" AND max(p.seq) = $4 - 1 FROM {s}.parts p WHERE p.body = $1)"
        )
        self._read = (
            f"SELECT p.data FROM {s}.parts p JOIN {s}.bodies b ON b.id = p.body"
            " WHERE p.body = $1 AND p.seq = $2 AND b.key = $3"
        )
        self._drop = f"DELETE FROM {s}.bodies WHERE id = $1 AND key = $2"
        self._sweep = (
            f"DELETE FROM {s}.bodies WHERE id IN (SELECT id FROM {s}.bodies"
            f" WHERE expires < {_NOW} ORDER BY expires LIMIT {_SWEEP_ROWS}"
            " FOR UPDATE SKIP LOCKED)"
        )

    # -- lifecycle (the store's) ---------------------------------------------------------

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        """Close the idle connections (one in use is closed when it comes back)."""
        self._open = False
        idle, self._idle = self._idle, []
        for conn in idle:
            _terminate(conn)

    # -- the PartStore -------------------------------------------------------------------

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        sweep = False
        if index == 0:
            now = asyncio.get_running_loop().time()
            # An owner that starts a body sweeps expired ones, at most every minute (or
            # every grace, when that is shorter) per process.
            sweep = now - self._swept >= min(_SWEEP_EVERY, self.grace)
            if sweep:
                self._swept = now
        status = await self._run(self._write, body, key, index, data, self.grace)
        if status != "INSERT 0 1":
            raise StoreError("a body part was refused: its id belongs to another key")
        if sweep:
            self._background(self._sweep)

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        status = await self._run(
            self._keep, parts.id, key, ttl + _KEPT_MARGIN, parts.count, parts.length
        )
        if status != "UPDATE 1":
            raise StoreError("a body streamed to PostgreSQL is not whole; not stored")

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        found: Any = await self._run(self._read, parts.id, index, key, fetch=True)
        return None if found is None else bytes(found)

    def drop(self, key: str, body: int) -> None:
        self._background(self._drop, body, key)

    # -- connections ---------------------------------------------------------------------

    async def _run(self, sql: str, *args: Any, fetch: bool = False) -> Any:
        """``sql`` on a parts connection: its status (``fetch``: its one value)."""
        if not self._open:
            raise StoreError("the PostgreSQL store is not open")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Connections belong to the loop they were opened on: the store moved.
            self._loop = loop
            self._slots = asyncio.Semaphore(self._size)
            idle, self._idle = self._idle, []
            for old in idle:
                _terminate(old)
        slots = self._slots
        if slots is None:  # pragma: no cover - set above
            raise StoreError("the PostgreSQL store is not open")
        try:
            async with asyncio.timeout(self._deadline), slots:
                conn = self._idle.pop() if self._idle else await self._connect()
                try:
                    send = conn.fetchval if fetch else conn.execute
                    result = await send(sql, *args)
                except BaseException:
                    _terminate(conn)  # its state is unknown
                    raise
                if self._open and self._loop is loop:
                    self._idle.append(conn)
                else:
                    _terminate(conn)
                return result
        except TimeoutError:
            raise StoreError(f"PostgreSQL did not answer within {self._deadline:g}s") from None
        except StoreError:
            raise
        except Exception as exc:  # driver and server errors alike
            raise StoreError(redact(f"PostgreSQL store (body parts): {exc}")) from exc

    def _background(self, sql: str, *args: Any) -> None:
        """Run ``sql`` soon, without waiting for it; a failure is logged."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: a body left behind expires on its own
        task = loop.create_task(self._quietly(sql, *args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quietly(self, sql: str, *args: Any) -> None:
        try:
            await self._run(sql, *args)
        except StoreError as exc:
            logger.warning("porch: deleting body parts failed (they expire later): %s", exc)


def _terminate(conn: Any) -> None:
    try:
        conn.terminate()
    except Exception as exc:  # a connection of a loop that closed: nothing left to save
        logger.debug("porch: closing a body parts connection: %r", exc)
