"""Bodies in parts (the store's :class:`~porch.store.base.PartStore`): one hash per body.

A body streamed here is a hash ``P:p:{tag}:<key>US<id>`` of part index -> bytes, in
its record's slot. Each part written (``part.lua``) sets its TTL to ``grace``, so a
body no record will name (its owner died mid-stream) goes ``grace`` after its
newest part; ``keep.lua`` checks it is whole and sets its TTL past the response's,
just before the Save that names it, so a body outlives its record. Parts go on the
store's client directly, never in a batch's pipeline: a megabyte part would hold
the decisions pipelined behind it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import StoreError
from ..base import Parts
from .commands import Command
from .keys import KeyNames

__all__ = ["PART_BYTES", "RedisParts"]

logger = logging.getLogger("porch.store")

PART_BYTES = 1 << 20
# A kept body outlives its record's TTL by this much (the Save that names it is sent
# right after, and answered within the store's timeout).
_KEPT_MARGIN = 300.0


class RedisParts:
    """Parts of streamed bodies; ``execute`` runs commands on the store's client."""

    part_bytes = PART_BYTES

    def __init__(
        self,
        names: KeyNames,
        execute: Callable[[list[Command]], Awaitable[list[Any]]],
        delete: Callable[[bytes], Awaitable[Any]],
        *,
        grace: float,
    ) -> None:
        self._names = names
        self._execute = execute
        self._delete = delete
        self.grace = grace
        self._tasks: set[asyncio.Task[None]] = set()

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        name = self._names.body(key, body)
        await self._execute([("part", [name], [index, data, _ms(self.grace)])])

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        name = self._names.body(key, parts.id)
        (kept,) = await self._execute(
            [("keep", [name], [parts.count, parts.length, _ms(ttl + _KEPT_MARGIN)])]
        )
        if kept != 1:
            raise StoreError("a body streamed to Redis is not whole; not stored")

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        name = self._names.body(key, parts.id)
        ((found,),) = await self._execute([(None, [name], [str(index)])])
        return None if found is None else bytes(found)

    def drop(self, key: str, body: int) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the body expires on its own
        task = loop.create_task(self._drop(self._names.body(key, body)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, name: bytes) -> None:
        try:
            await self._delete(name)
        except Exception as exc:
            logger.warning("porch: deleting body parts failed (they expire later): %s", exc)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
