"""Group pipelining: what every shard of a process queued goes out as one pipeline.

A shard drains its mailbox into one batch, but a process has several shards,
and each sending its own pipeline would split the round trips that one
pipeline could carry. Batches queue here instead; while ``limit`` pipelines
are in flight, new batches wait and leave together in the next one (the
SQLite store's writer thread does the same with transactions).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import StoreError

__all__ = ["GroupPipeline"]

_Job = tuple[list[Any], "asyncio.Future[list[Any]]"]


class GroupPipeline:
    """Send queued command lists through ``send`` (one pipeline per call), ``limit`` at a time."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any]]], *, limit: int) -> None:
        self._send = send
        self._limit = limit
        self._queue: list[_Job] = []
        self._senders: set[asyncio.Task[None]] = set()
        self.pipelines = 0

    async def run(self, commands: list[Any]) -> list[Any]:
        """The results of ``commands`` (a command's error in its place); StoreError if unsent."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((commands, future))
        if len(self._senders) < self._limit:
            task = loop.create_task(self._drain(), name="porch-redis-pipeline")
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)  # also if cancelled unstarted
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                jobs, self._queue = self._queue, []
                try:
                    results = await self._send([c for commands, _ in jobs for c in commands])
                except StoreError as exc:
                    # The server is away or too slow: batches queued meanwhile would only
                    # wait out another timeout, so they fail now too.
                    jobs += self._queue
                    self._queue = []
                    for _, future in jobs:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException as exc:
                    for _, future in jobs:
                        if not future.done():
                            future.set_exception(StoreError(repr(exc)))
                    raise
                self.pipelines += 1
                start = 0
                for commands, future in jobs:
                    end = start + len(commands)
                    if not future.done():
                        future.set_result(results[start:end])
                    start = end
        finally:
            # Out of the count as soon as the queue is found empty (no await in between).
            # Its done-callback comes a loop step later: a batch queued in that step (the
            # continuation of a caller just answered) found every sender counted, none
            # left to send it, and waited for ever.
            task = asyncio.current_task()
            if task is not None:
                self._senders.discard(task)
