from __future__ import annotations

import asyncio

import pytest

from porch.errors import ConfigurationError, PoolClosedError, SaturatedError
from porch.pool._mailbox import Mailbox

pytestmark = pytest.mark.anyio


def test_capacity_below_one_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="mailbox capacity must be >= 1, got 0"):
        Mailbox[int](0)


async def test_full_mailbox_raises_at_once_and_counts_saturations() -> None:
    box = Mailbox[int](2, index=3)
    box.send_nowait(1)
    box.send_nowait(2)
    with pytest.raises(SaturatedError) as info:
        box.send_nowait(3)
    assert info.value.shard == 3
    assert info.value.capacity == 2
    stats = box.statistics()
    assert (stats.queued, stats.sent, stats.saturations) == (2, 2, 1)


async def test_receive_takes_everything_queued_in_order() -> None:
    box = Mailbox[int](10)
    for i in range(5):
        box.send_nowait(i)
    assert await box.receive_batch() == [0, 1, 2, 3, 4]
    stats = box.statistics()
    assert (stats.queued, stats.batches, stats.largest_batch) == (0, 1, 5)


async def test_receiver_parks_until_a_send() -> None:
    box = Mailbox[str](4)
    task = asyncio.create_task(box.receive_batch())
    await asyncio.sleep(0)
    assert not task.done()
    box.send_nowait("x")
    assert await asyncio.wait_for(task, 1) == ["x"]


async def test_close_wakes_the_receiver_and_returns_what_was_queued() -> None:
    box = Mailbox[int](4)
    task = asyncio.create_task(box.receive_batch())
    await asyncio.sleep(0)
    assert box.close() == []
    assert await asyncio.wait_for(task, 1) == []
    with pytest.raises(PoolClosedError):
        box.send_nowait(1)
    assert box.statistics().closed


async def test_close_hands_back_undelivered_items() -> None:
    box = Mailbox[int](4)
    box.send_nowait(7)
    box.send_nowait(8)
    assert box.close() == [7, 8]
    assert await box.receive_batch() == []
