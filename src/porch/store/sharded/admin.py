"""The admin protocol over a sharded store: every command on every store, the answers merged.

Keys live on one home each, so listing, resetting and purging ask every store and
add up what they say; ``check`` reports each store's problems under its location
(one that cannot be reached is a problem of the whole, not an exception).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ...errors import StoreError
from ..admin import CheckReport, CounterInfo, PurgeReport, ResponseInfo, StoreAdmin

__all__ = ["ShardedAdmin"]

T = TypeVar("T")


class ShardedAdmin:
    """:class:`~porch.store.admin.StoreAdmin` over the stores of a sharded store."""

    def __init__(self, admins: Sequence[StoreAdmin]) -> None:
        self.admins = tuple(admins)
        self.location = " + ".join(admin.location for admin in self.admins)

    async def _each(self, work: Callable[[StoreAdmin], Awaitable[T]]) -> list[T]:
        results = await asyncio.gather(
            *(work(admin) for admin in self.admins), return_exceptions=True
        )
        answers: list[T] = []
        for admin, result in zip(self.admins, results, strict=True):
            if isinstance(result, StoreError):
                raise StoreError(f"{admin.location}: {result}") from result
            if isinstance(result, BaseException):
                raise result
            answers.append(result)
        return answers

    async def counters(self, *, client: str | None = None, most: int = 1000) -> list[CounterInfo]:
        found = await self._each(lambda admin: admin.counters(client=client, most=most))
        return [info for part in found for info in part][:most]

    async def responses(self, *, client: str | None = None, most: int = 1000) -> list[ResponseInfo]:
        found = await self._each(lambda admin: admin.responses(client=client, most=most))
        return [info for part in found for info in part][:most]

    async def reset(self, *, client: str, rule: str | None = None) -> int:
        return sum(await self._each(lambda admin: admin.reset(client=client, rule=rule)))

    async def forget(self, *, scope: str, key: str) -> int:
        return sum(await self._each(lambda admin: admin.forget(scope=scope, key=key)))

    async def purge(self) -> PurgeReport:
        reports = await self._each(lambda admin: admin.purge())
        return PurgeReport(sum(r.counters for r in reports), sum(r.responses for r in reports))

    async def check(self) -> CheckReport:
        results = await asyncio.gather(
            *(admin.check() for admin in self.admins), return_exceptions=True
        )
        problems: list[str] = []
        versions: list[int] = []
        expected: list[int] = []
        for admin, result in zip(self.admins, results, strict=True):
            if isinstance(result, CheckReport):
                versions.append(result.schema_version)
                expected.append(result.expected_version)
                problems += [f"{admin.location}: {problem}" for problem in result.problems]
            elif isinstance(result, Exception):
                problems.append(f"{admin.location}: cannot be checked: {result}")
            else:
                raise result
        return CheckReport(
            self.location,
            min(versions, default=0),
            max(expected, default=0),
            tuple(problems),
        )

    async def close(self) -> None:
        await asyncio.gather(*(admin.close() for admin in self.admins), return_exceptions=True)
