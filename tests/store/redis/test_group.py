"""The group pipeline's own bookkeeping: every queued batch is sent, whenever it comes.

``send`` here is a plain coroutine standing for one pipeline round trip, so the
scheduling is exact: a real server only moves where in a loop step things land.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from porch.store.redis.group import GroupPipeline

pytestmark = pytest.mark.anyio

DEADLINE = 5.0


async def test_a_batch_queued_as_the_last_sender_finishes_is_sent() -> None:
    # The caller's continuation runs before the finished sender's done-callback: it
    # queued its next batch while the sender still counted, and nobody sent it
    # (a cluster claim then its quota books: a demo request hung for ever).
    sent: list[list[Any]] = []

    async def send(commands: list[Any]) -> list[Any]:
        sent.append(commands)
        return commands

    group = GroupPipeline(send, limit=1)

    async def claim_then_books() -> list[Any]:
        await group.run(["claim"])
        return await group.run(["book"])

    assert await asyncio.wait_for(claim_then_books(), DEADLINE) == ["book"]
    assert sent == [["claim"], ["book"]]


async def test_chained_callers_over_two_senders_are_all_answered() -> None:
    sent: list[list[Any]] = []

    async def send(commands: list[Any]) -> list[Any]:
        sent.append(commands)
        await asyncio.sleep(0)  # a round trip: the others queue meanwhile
        return commands

    group = GroupPipeline(send, limit=2)

    async def caller(n: int) -> list[Any]:
        return [await group.run([(n, step)]) for step in range(5)]

    answers = await asyncio.wait_for(asyncio.gather(*(caller(n) for n in range(50))), DEADLINE)
    assert answers == [[[(n, step)] for step in range(5)] for n in range(50)]
    assert sorted(c for batch in sent for c in batch) == [
        (n, step) for n in range(50) for step in range(5)
    ]
    assert len(sent) < 250  # grouped: batches queued meanwhile left together
