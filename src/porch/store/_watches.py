"""Waiting for a claim held on another host, for the network stores: one listener, no polling.

A store whose claims are leases tells waiters elsewhere that a claim came free
with a message: every :class:`~porch.store.base.Save` and
:class:`~porch.store.base.Release` sends one (PostgreSQL ``NOTIFY``, Redis
``PUBLISH``), naming the key by a *wake id* (the key, or a digest of it). Each
process keeps one connection listening (a :class:`Channel`, the backend's part)
and :class:`Watches` dispatches each message to the watches of its key. The
rest is the same for every such store and lives here:

- a message that arrives just before its watch (the claim that found the key
  held and the holder's save crossed on the wire) is kept for ``RECENT`` seconds,
  and a watch that finds it wakes at once;
- every watch has a timer at the holder's lease end (``AFTER_LEASE`` past it):
  the backstop for a holder that died (no message ever comes) and for a listener
  that is away. Without a known lease end (``retry_after=None``) the timer is
  one whole lease: a lease is never renewed further ahead than that;
- whenever the listener (re)subscribes, every watched key is woken once: what was
  sent while it was not listening is lost, and a spurious wake costs one claim;
- the listener reconnects by itself (backing off up to ``reconnect_delay``), and
  stops on any event loop, also after the loop it ran on has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .._tasks import stop_if_cancelled, stop_task

__all__ = ["AFTER_LEASE", "RECENT", "RECONNECT_DELAY", "Channel", "Watches"]

# A message nobody watched yet is kept this long (loop seconds), at most _RECENT_MAX of them.
RECENT = 2.0
_RECENT_MAX = 4096
# The backstop fires this long after the lease's end, so the re-claim finds it lapsed
# on the server's clock too (the timer counts from the reply, and may fire a tick early).
AFTER_LEASE = 0.05
# The first retry after the listener lost its connection; later ones back off to
# ``reconnect_delay`` (by default this).
_FIRST_RETRY = 0.1
RECONNECT_DELAY = 0.5


class Channel(Protocol):
    """How a backend's messages arrive: one subscription, on a connection of its own."""

    #: What the logs call it ("the PostgreSQL LISTEN connection").
    name: str

    async def listen(self, deliver: Callable[[str], None], ready: Callable[[], None]) -> None:
        """Connect and subscribe, call ``ready()`` once subscribed (again each time it
        resubscribes by itself), then ``deliver(wake_id)`` for each message, on the loop.

        Returns or raises when the connection is lost; every await is bounded. It
        closes its connection on the way out, cancelled too.
        """
        ...


class _Watch:
    __slots__ = ("done", "owner", "timer", "wake", "wake_id")

    def __init__(self, owner: Watches, wake_id: str, wake: Callable[[], None]) -> None:
        self.owner = owner
        self.wake_id = wake_id
        self.wake = wake
        self.done = False
        self.timer: asyncio.Handle | None = None

    def fire(self) -> None:
        if self.done:
            return
        self.cancel()
        try:
            self.wake()
        except Exception:  # one waiter's bug must not stop the others' wake-ups
            self.owner.logger.exception("porch: a claim's wake-up failed")

    def cancel(self) -> None:
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        watches = self.owner.watches.get(self.wake_id)
        if watches is not None:
            watches.discard(self)
            if not watches:
                del self.owner.watches[self.wake_id]


class Watches:
    """A network store's :class:`~porch.store.base.Claims`: watches fed by one listener.

    ``wake_id(key)``: the id a message names ``key`` by. ``lease``: the store's
    lease, the backstop of a watch without ``retry_after``. ``reconnect_delay``:
    the longest wait between two attempts to subscribe again.
    """

    def __init__(
        self,
        channel: Channel,
        wake_id: Callable[[str], str],
        *,
        lease: float,
        reconnect_delay: float = RECONNECT_DELAY,
        logger: logging.Logger,
    ) -> None:
        self.channel = channel
        self.wake_id = wake_id
        self.lease = lease
        self.reconnect_delay = reconnect_delay
        self.logger = logger
        self.watches: dict[str, set[_Watch]] = {}
        self._recent: OrderedDict[str, float] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        #: Set while subscribed (tests wait on it; a store's open() may).
        self.connected = asyncio.Event()
        #: Subscriptions made again after the first one (each woke every watch).
        self.reconnects = 0
        self._subscribed_once = False
        self._failing = False
        self._delay = _FIRST_RETRY

    # -- Claims ------------------------------------------------------------------------

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        wake_id = self.wake_id(key)
        watch = _Watch(self, wake_id, wake)
        seen = self._recent.pop(wake_id, None)
        if seen is not None and loop.time() - seen <= RECENT:
            # Freed while our claim's answer was on its way: look again now.
            watch.timer = loop.call_soon(watch.fire)
            return watch.cancel
        self.watches.setdefault(wake_id, set()).add(watch)
        delay = self.lease if retry_after is None else max(0.0, retry_after)
        watch.timer = loop.call_later(delay + AFTER_LEASE, watch.fire)
        return watch.cancel

    def watched(self) -> int:
        """How many watches are waiting (for tests and statistics)."""
        return sum(len(w) for w in self.watches.values())

    # -- what the listener delivers ----------------------------------------------------

    def _deliver(self, wake_id: str) -> None:
        watches = self.watches.get(wake_id)
        if watches:
            for watch in list(watches):
                watch.fire()
            return
        now = asyncio.get_running_loop().time()
        recent = self._recent
        recent[wake_id] = now
        recent.move_to_end(wake_id)  # arrival order: the oldest first
        while recent and (len(recent) > _RECENT_MAX or now - next(iter(recent.values())) > RECENT):
            recent.popitem(last=False)

    def _ready(self) -> None:
        self.connected.set()
        self._delay = _FIRST_RETRY
        if self._failing:
            self.logger.info("porch: %s is back", self.channel.name)
            self._failing = False
        if self._subscribed_once:
            self.reconnects += 1
        self._subscribed_once = True
        # Messages sent while not subscribed are lost: everyone looks again. The first
        # subscription too: a store need not wait for it, so a key may have been
        # watched (and freed) before it began.
        for watches in list(self.watches.values()):
            for watch in list(watches):
                watch.fire()

    # -- the listener ------------------------------------------------------------------

    def start(self) -> None:
        """Start listening on the running loop (in the background; ``connected`` says when)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and task.get_loop() is not loop:
            # Left on a loop that stopped (a stop() cut short): it never runs here.
            with contextlib.suppress(RuntimeError):  # that loop is closed
                task.cancel()
            self._task = None
        if self._task is None:
            self.connected = asyncio.Event()
            self._subscribed_once = self._failing = False
            self._delay = _FIRST_RETRY
            self._task = loop.create_task(self._listen(), name="porch-wake-listener")

    async def stop(self) -> None:
        """Stop listening and forget every watch (none is woken); on any loop, bounded."""
        task, self._task = self._task, None
        # Of a loop that stopped (the store moved to this one), it is only cancelled, never
        # awaited: a loop shutting down cancelled its tasks, which closed the connection;
        # one that only stopped closes it if it runs again.
        await stop_task(task)
        for watches in list(self.watches.values()):
            for watch in list(watches):
                watch.cancel()
        self._recent.clear()
        self.connected.clear()

    async def _listen(self) -> None:
        while True:
            # A cancel that an await lost (Python 3.11's wait_for, in a driver) still ends
            # this task at its next turn: see porch._tasks.
            stop_if_cancelled()
            try:
                await self.channel.listen(self._deliver, self._ready)
                problem = "the connection closed"
            except Exception as exc:  # the connection's or the server's
                problem = str(exc) or type(exc).__name__
            finally:  # cancelled too: nothing listens any more
                self.connected.clear()
            if not self._failing:  # once per outage
                self.logger.warning(
                    "porch: %s failed (%s); reconnecting", self.channel.name, problem
                )
                self._failing = True
            await asyncio.sleep(self._delay)
            self._delay = min(self._delay * 2, self.reconnect_delay)
