"""Slices of a hot limit: units a host leases from the store and gives out itself.

A limit every request shares (a global cap, a tenant's) puts every decision of
every host on one counter. With ``Limit(slice=n)`` a host charges ``n`` units to
that counter at once instead — a lease, which is an ordinary hit of cost ``n``,
decided by the store like any other — and then admits requests from those units
itself, until they are spent or the window they were charged to ends.

Every unit admitted was charged first, in the window it is admitted in: a slice
is given out only until its window's end as this host's clock puts it, counted
from when the lease was *sent* (before the store read its clock), so never past
the store's own end. The limit is never exceeded. What it may under-admit is
what hosts hold unspent when the window ends, under one slice each, and a host
that stops returns what it holds (:meth:`SliceBook.drain`, a refund). Stated
and tested in docs/design.md, "Slices".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from ..clock import Clock
from ..errors import PorchError
from ..store.base import Hit, Settle

__all__ = ["Lease", "Slice", "SliceBook"]

#: Charge ``cost`` units to a fixed-window limit's counter at the store, as one hit
#: (key, amount, window, cost): the store's decision, or the error that kept it from one.
Lease = Callable[[str, int, float, int], Awaitable[Hit | PorchError]]


class Slice:
    """What this host holds of one counter's window."""

    __slots__ = ("amount", "leasing", "left", "spent", "stamp", "units", "until", "window")

    def __init__(self, amount: int, window: float) -> None:
        self.amount = amount
        self.window = window
        self.units = 0  # leased to this host and not given out yet
        # (This host's monotonic clock.) Before it, the window the units were charged to
        # has surely not ended at the store; at it, they are dropped.
        self.until = -math.inf
        self.stamp = 0.0  # the store's window the units were charged to (a refund names it)
        self.left = 0  # the units the store had left after this host's last lease
        self.spent = False  # the store had none to lease for this window: refuse until then
        # The lease in flight, which every taker of the key waits for.
        self.leasing: asyncio.Future[PorchError | None] | None = None

    def remaining(self) -> int:
        """What a client is told is left: the store's, as of the last lease, and this host's."""
        return self.left + self.units


def _retrieved(task: asyncio.Future[PorchError | None]) -> None:
    """A lease whose requester was cancelled: its failure is not left unretrieved."""
    if not task.cancelled():
        task.exception()


class SliceBook:
    """This host's slices of its sliced limits, by counter key (one middleware's)."""

    __slots__ = ("_clock", "_slices", "_sweep_at")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._slices: dict[str, Slice] = {}
        # Ended slices are dropped when the book grows past this (then twice its size):
        # a per-tenant level's keys come and go with their windows.
        self._sweep_at = 64

    async def take(
        self, key: str, amount: int, window: float, size: int, cost: int, lease: Lease
    ) -> tuple[Slice, bool] | PorchError:
        """Take ``cost`` units of ``key``'s slice, leasing ``size`` more (or the request's
        cost, if larger) when it runs short: the slice, and whether the units were taken.
        One lease per key is in flight at a time; other takers wait for it."""
        while True:
            found = self._slices.get(key)
            if found is None:
                if len(self._slices) >= self._sweep_at:
                    self._forget_ended()
                    self._sweep_at = max(64, 2 * len(self._slices))
                found = self._slices[key] = Slice(amount, window)
            if found.leasing is not None:
                await asyncio.wait([found.leasing])  # (its outcome is its leaser's)
                continue
            if self._clock.monotonic() >= found.until:
                # The window they were charged to may have ended: units given out now
                # could count in the next one, uncharged. Dropped (the under-use bound).
                found.units = 0
                found.spent = False
            elif found.units >= cost:
                found.units -= cost
                return found, True
            elif found.spent:
                return found, False
            leasing = found.leasing = asyncio.ensure_future(
                self._lease(found, key, max(size, cost - found.units), cost, lease)
            )
            leasing.add_done_callback(_retrieved)
            # Shielded: a lease the store decides is charged, so a request cancelled while
            # it travels (its client gone) must not drop the units it brings.
            failed = await asyncio.shield(leasing)
            if failed is not None:
                return failed

    async def _lease(
        self, found: Slice, key: str, want: int, cost: int, lease: Lease
    ) -> PorchError | None:
        """Lease ``want`` units for ``found``; at a window's tail, what is left if that still
        covers ``cost``; else mark the window spent."""
        try:
            return await self._leasing(found, key, want, cost, lease)
        finally:
            found.leasing = None

    async def _leasing(
        self, found: Slice, key: str, want: int, cost: int, lease: Lease
    ) -> PorchError | None:
        while True:
            sent = self._clock.monotonic()
            hit = await lease(key, found.amount, found.window, want)
            if not isinstance(hit, Hit):
                return hit
            if hit.stamp[0] != found.stamp:
                # Another window than the units held: theirs has ended at the store.
                found.units = 0
                found.stamp = hit.stamp[0]
            # A fixed window's next is the time to its end, as the store saw it after
            # ``sent``: counted from ``sent``, the end this host uses is never later.
            found.until = sent + hit.next[0]
            found.left = hit.remaining[0]
            if hit.allowed:
                found.units += want
                found.spent = False
                return None
            if cost - found.units <= hit.remaining[0] < want:
                want = hit.remaining[0]  # the window's last units: enough for this request
                continue
            found.spent = True
            return None

    def give(self, key: str, found: Slice, stamp: float, units: int) -> None:
        """Give back ``units`` taken from ``found`` (for a request another limit refused),
        unless its window has changed since."""
        if self._slices.get(key) is found and found.stamp == stamp and units:
            found.units += units

    def drain(self) -> list[Settle]:
        """Every slice's unspent units, as refunds to their windows; the book is emptied
        (a host that stops returns what it holds)."""
        now = self._clock.monotonic()
        refunds = [
            Settle([key], [found.amount], [found.window], [-found.units], [found.stamp])
            for key, found in self._slices.items()
            if found.units and now < found.until
        ]
        self._slices.clear()
        return refunds

    def _forget_ended(self) -> None:
        """Drop the slices whose windows have ended (nothing to give back there)."""
        now = self._clock.monotonic()
        ended = [
            key
            for key, found in self._slices.items()
            if now >= found.until and found.leasing is None
        ]
        for key in ended:
            del self._slices[key]
