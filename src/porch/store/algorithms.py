"""The policies' arithmetic in Python, in the exact order docs/design.md ("Policies") states.

One counter key's state is ``(n, p, s)``: the count, the previous window's count
(sliding only) and a time (a fixed or sliding window's start, gcra's theoretical
arrival time), plus when the row may go (:func:`expiry`) and the algorithm's tag.
Every backend computes the same IEEE doubles in the same order, so their
verdicts and reports agree to the bit; this module is the SQLite store's (and a
network store may fill its reports from the state its server returns).

A state is read with :func:`read` (absent, expired or another algorithm's row:
fresh; an elapsed window rolled), tested with :func:`fits`, charged with
:func:`charge` only when the whole hit is allowed (a refused hit writes nothing,
not even its roll), and reported with :func:`report` after the decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .base import Algorithm, Hit

__all__ = [
    "EPS",
    "FIXED",
    "GCRA",
    "SLIDING",
    "TAGS",
    "Report",
    "State",
    "charge",
    "expiry",
    "fill_reports",
    "fits",
    "fresh",
    "read",
    "report",
    "settle",
]

EPS = 1e-9
FIXED, SLIDING, GCRA = 0, 1, 2
TAGS: dict[Algorithm, int] = {"fixed": FIXED, "sliding": SLIDING, "gcra": GCRA}

State = tuple[int, int, float]
# A limit's (remaining, next, full, retry, stamp) after a decision: see report.
Report = tuple[int, float, float, float, float]
"""``(n, p, s)`` of one counter key."""

_floor = math.floor


def fresh(tag: int, t: float) -> State:
    """The state of a key with no row (or an expired one, or another algorithm's)."""
    return 0, 0, t


def read(tag: int, n: int, p: int, s: float, t: float, window: float) -> State:
    """A live row's state as a hit at ``t`` sees it: an elapsed window rolled over."""
    if tag == FIXED:
        if t >= s + window:
            return 0, 0, t
        return n, p, s
    if tag == SLIDING:
        if t >= s + 2 * window:
            return 0, 0, t
        if t >= s + window:
            return 0, n, s + window
        return n, p, s
    return 0, 0, s if s > t else t  # gcra: tat = max(s, t)


def expiry(tag: int, s: float, window: float) -> float:
    """When a row holding state ``s`` may be deleted (``t >= e``: read as absent)."""
    if tag == FIXED:
        return s + window
    if tag == SLIDING:
        return s + 2 * window
    return s


def fits(
    tag: int, state: State, t: float, cost: int, amount: int, window: float, burst: int
) -> bool:
    """Whether ``cost`` more units fit this limit now."""
    n, p, s = state
    if tag == FIXED:
        return n + cost <= amount
    if tag == SLIDING:
        w = (window - (t - s)) / window
        return p * w + n + cost <= amount + EPS
    interval = window / amount
    return (s - t) + cost * interval <= interval * burst + EPS * interval


def charge(tag: int, state: State, cost: int, amount: int, window: float) -> State:
    """The state once an allowed hit's ``cost`` is counted."""
    n, p, s = state
    if tag == GCRA:
        return 0, 0, s + cost * (window / amount)
    return n + cost, p, s


def fill_reports(hit: Hit, reports: Sequence[Report], wall: float) -> None:
    """Write each limit's :func:`report` into ``hit``'s results, and the decisions'
    ``wall`` time (its verdict and ``fits`` are the caller's)."""
    hit.remaining = [r[0] for r in reports]
    hit.next = [r[1] for r in reports]
    hit.full = [r[2] for r in reports]
    hit.retry = [r[3] for r in reports]
    hit.stamp = [r[4] for r in reports]
    hit.wall = wall


def report(
    tag: int, state: State, t: float, cost: int, amount: int, window: float, burst: int
) -> Report:
    """``(remaining, next, full, retry, stamp)`` of a limit after the decision."""
    n, p, s = state
    if tag == FIXED:
        left = s + window - t
        return (amount - n if n < amount else 0), left, left, left, s
    if tag == SLIDING:
        w = (window - (t - s)) / window
        est = p * w + n
        remaining = min(amount, max(0, _floor(amount - est + EPS)))
        return (
            remaining,
            _until(amount - remaining - 1, n, p, s, t, w, window) if remaining < amount else 0.0,
            _until(0, n, p, s, t, w, window),
            _until(amount - cost, n, p, s, t, w, window),
            s,
        )
    interval = window / amount
    tau = interval * burst
    level = s - t if s > t else 0.0
    remaining = min(burst, max(0, _floor((tau - level) / interval + EPS)))
    return (
        remaining,
        max(0.0, level - (burst - remaining - 1) * interval) if remaining < burst else 0.0,
        level,
        max(0.0, level + cost * interval - tau),
        0.0,
    )


def _until(x: int, n: int, p: int, s: float, t: float, w: float, window: float) -> float:
    """The least d >= 0 with the sliding estimate at t + d <= x + EPS (no more hits)."""
    if p * w + n <= x + EPS:
        return 0.0
    left = s + window - t
    if n <= x + EPS:  # within this window (then p > 0)
        return (window - (t - s)) - (x - n) * window / p
    if x < 0:  # never fits: when everything has drained
        return left + window
    return left + window * (n - x) / n  # in the next window, where n is the previous count


def settle(
    tag: int,
    state: State,
    t: float,
    delta: int,
    stamp: float,
    amount: int,
    window: float,
) -> State | None:
    """The state once ``delta`` units are settled on a hit counted in window ``stamp``
    (``state`` read at ``t``); None: nothing to write (a refund to a window that has
    gone, a refund to a full bucket, or ``delta`` 0)."""
    if delta == 0:
        return None
    n, p, s = state
    if tag == FIXED:
        if s == stamp:
            return max(0, n + delta), p, s
        if delta > 0:  # a debt follows the client into the current window
            return n + delta, p, s
        return None
    if tag == SLIDING:
        if s == stamp:
            return max(0, n + delta), p, s
        if s == stamp + window:  # the reservation's window is now the previous one
            return n, max(0, p + delta), s
        if delta > 0:
            return n + delta, p, s
        return None
    interval = window / amount
    if delta > 0:
        return 0, 0, (s if s > t else t) + delta * interval
    if s > t:
        tat = s + delta * interval
        return 0, 0, tat if tat > t else t
    return None
