"""Waiting for a claim held on another host: one pub/sub connection per process, no polling.

Save and Release scripts ``PUBLISH`` the logical key on the store's channel.
Each process subscribes once (at open) and dispatches messages to the
callbacks watching that key. A wake-up can arrive just before the watch that
wants it (the claim's reply and the message travel on different
connections), so a message nobody was watching is remembered for a moment
and a watch that finds it wakes at once. Every watch also has a timer at the
holder's lease end: the backstop when a message is lost (the holder died, or
the connection dropped). After the subscription is re-established, every
watched key is woken once, since messages may have been missed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._tasks import stop_if_cancelled, stop_task

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["RedisClaims"]

logger = logging.getLogger("porch.store")

# A wake-up nobody was watching yet is kept this long (loop seconds), at most _RECENT_MAX.
_RECENT_FOR = 2.0
_RECENT_MAX = 4096
# The backstop timer fires this long after the lease's end, so the re-claim finds it lapsed.
_AFTER_LEASE = 0.05
# Closing the subscription never waits longer on a server that does not answer.
_CLOSE_TIMEOUT = 1.0


class _Watch:
    __slots__ = ("fired", "key", "owner", "timer", "wake")

    def __init__(self, owner: RedisClaims, key: str, wake: Callable[[], None]) -> None:
        self.owner = owner
        self.key = key
        self.wake = wake
        self.timer: asyncio.TimerHandle | None = None
        self.fired = False

    def fire(self) -> None:
        if self.fired:
            return
        self.cancel()
        try:
            self.wake()
        except Exception:  # one waiter's bug must not stop the others' wake-ups
            logger.exception("porch: a claim wake-up failed")

    def cancel(self) -> None:
        self.fired = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        watches = self.owner.watches.get(self.key)
        if watches is not None:
            watches.discard(self)
            if not watches:
                del self.owner.watches[self.key]


class RedisClaims:
    """The store's :class:`~porch.store.base.Claims`: pub/sub wake-ups plus lease-end timers."""

    def __init__(self, channel: bytes, *, reconnect_delay: float) -> None:
        self.channel = channel
        self.reconnect_delay = reconnect_delay
        self.watches: dict[str, set[_Watch]] = {}
        self._recent: OrderedDict[str, float] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Event | None = None
        self.reconnects = 0

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        watch = _Watch(self, key, wake)
        seen = self._recent.pop(key, None)
        if seen is not None and loop.time() - seen <= _RECENT_FOR:
            watch.fired = True
            loop.call_soon(wake)
            return watch.cancel
        self.watches.setdefault(key, set()).add(watch)
        if retry_after is not None:
            watch.timer = loop.call_later(max(0.0, retry_after) + _AFTER_LEASE, watch.fire)
        return watch.cancel

    # -- the subscriber ------------------------------------------------------------

    async def start(self, client: Redis, wait: float) -> None:
        """Subscribe on ``client`` (a connection of its own); return once subscribed."""
        self._subscribed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._listen(client), name="porch-redis-claims"
        )
        try:
            async with asyncio.timeout(wait):
                await self._subscribed.wait()
        except TimeoutError:
            await self.stop()
            raise

    async def stop(self) -> None:
        task, self._task = self._task, None
        # Of a loop that stopped (the store moved to this one), it is only cancelled.
        await stop_task(task)
        for watches in list(self.watches.values()):
            for watch in list(watches):
                watch.cancel()
        self._recent.clear()

    async def _listen(self, client: Redis) -> None:
        first = True
        failing = False
        while True:
            # A cancel that redis-py lost (Python 3.11's wait_for, in its send path) still
            # ends this task before it waits on the channel again: see porch._tasks.
            stop_if_cancelled()
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                stop_if_cancelled()
                async for message in pubsub.listen():
                    stop_if_cancelled()
                    kind = message["type"]
                    if kind == "message":
                        self._dispatch(message["data"])
                    elif kind == "subscribe":
                        if failing:
                            logger.warning("porch: Redis wake-up channel reconnected")
                            failing = False
                        if not first:
                            # Messages may have been missed while disconnected.
                            self.reconnects += 1
                            self._wake_all()
                        first = False
                        if self._subscribed is not None:
                            self._subscribed.set()
            except asyncio.CancelledError:
                await _close(pubsub)
                raise
            except Exception as exc:
                if not failing:
                    logger.warning("porch: Redis wake-up channel lost (%s); reconnecting", exc)
                    failing = True
            await _close(pubsub)
            await asyncio.sleep(self.reconnect_delay)

    def _dispatch(self, data: Any) -> None:
        key = bytes(data).decode("utf-8", "surrogatepass")
        watches = self.watches.get(key)
        if watches:
            for watch in list(watches):
                watch.fire()
            return
        now = asyncio.get_running_loop().time()
        recent = self._recent
        recent[key] = now
        recent.move_to_end(key)
        while recent and (
            len(recent) > _RECENT_MAX or now - next(iter(recent.values())) > _RECENT_FOR
        ):
            recent.popitem(last=False)

    def _wake_all(self) -> None:
        for watches in list(self.watches.values()):
            for watch in list(watches):
                watch.fire()


async def _close(pubsub: Any) -> None:
    # Already broken, perhaps: nothing is left to close cleanly then.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_CLOSE_TIMEOUT):
            await pubsub.aclose()
