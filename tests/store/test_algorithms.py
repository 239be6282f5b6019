"""The policies' arithmetic (porch.store.algorithms) on the cases docs/design.md describes.

The conformance suite compares every store with the reference model on random runs;
these are the behaviours the design names, with their numbers, so a reader sees
each algorithm's edge behaviour and the sliding approximation's error.
"""

from __future__ import annotations

import pytest

from porch.store.algorithms import (
    FIXED,
    GCRA,
    SLIDING,
    State,
    charge,
    fits,
    fresh,
    read,
    report,
    settle,
)


class Key:
    """One counter key under one limit: hits at moments, written only when allowed."""

    def __init__(self, tag: int, amount: int, window: float, burst: int | None = None) -> None:
        self.tag, self.amount, self.window = tag, amount, window
        self.burst = amount if burst is None else burst
        self.state: State | None = None

    def now(self, t: float) -> State:
        if self.state is None:
            return fresh(self.tag, t)
        n, p, s = self.state
        return read(self.tag, n, p, s, t, self.window)

    def hit(self, t: float, cost: int = 1) -> bool:
        state = self.now(t)
        if not fits(self.tag, state, t, cost, self.amount, self.window, self.burst):
            return False
        self.state = charge(self.tag, state, cost, self.amount, self.window)
        return True

    def report(self, t: float, cost: int = 1) -> tuple[int, float, float, float, float]:
        return report(self.tag, self.now(t), t, cost, self.amount, self.window, self.burst)

    def passed(self, moments: list[float]) -> int:
        return sum(self.hit(t) for t in moments)


def test_a_fixed_window_lets_twice_its_amount_through_across_its_edge() -> None:
    key = Key(FIXED, 10, 60.0)
    assert key.hit(0.0)  # the window starts at the first hit: [0, 60)
    assert key.passed([59.0] * 20) == 9
    assert key.passed([60.0] * 20) == 10  # a new window: 19 requests in one second


def test_a_sliding_window_weighs_the_previous_one_by_its_overlap() -> None:
    key = Key(SLIDING, 10, 60.0)
    assert key.passed([0.0] + [59.0] * 20) == 10
    # At 60 s the previous window (10) still overlaps fully: nothing passes.
    assert key.passed([60.0] * 5) == 0
    # At 66 s it overlaps 90%: an estimate of 9, so one more.
    assert key.report(66.0)[0] == 1
    assert key.passed([66.0] * 5) == 1
    # Across the edge at most 11 passed in the 60 s from 6 s to 66 s, not 20.


def test_the_sliding_estimate_assumes_the_previous_window_was_even() -> None:
    # Its error: 10 requests at the very start of the previous window are long gone at
    # 90 s, yet weighed as if spread over it (half of them still counted): the estimate
    # refuses early, never late, for traffic front-loaded in a window.
    front = Key(SLIDING, 10, 60.0)
    assert front.passed([0.0] * 10) == 10
    assert front.report(90.0)[0] == 5
    # Back-loaded (all at 59 s) it lets through more than a true sliding log would (at
    # 90 s the true count of the last 60 s is 10): the estimate errs both ways, by up to
    # the previous window's count times the overlap's error.
    back = Key(SLIDING, 10, 60.0)
    assert back.hit(0.0)
    assert back.passed([59.0] * 9) == 9
    assert back.report(90.0)[0] == 5


def test_sliding_reports_when_units_come_back() -> None:
    key = Key(SLIDING, 10, 60.0)
    key.passed([0.0] * 10)
    remaining, after, whole, retry, start = key.report(60.0, cost=3)
    # At 60 s: previous window 10, weight 1. One unit back when the weight is 0.9 (6 s),
    # three (this request's cost) at 0.7 (18 s), all when the window has gone (60 s).
    assert (remaining, start) == (0, 60.0)
    assert (after, retry, whole) == pytest.approx((6.0, 18.0, 60.0))


def test_gcra_is_a_bucket_of_burst_units_refilled_at_the_rate() -> None:
    key = Key(GCRA, 10, 60.0, burst=3)  # one unit per 6 s, three at once
    assert key.passed([0.0] * 5) == 3
    assert key.report(0.0) == pytest.approx((0, 6.0, 18.0, 6.0, 0.0))
    assert key.passed([5.9]) == 0
    assert key.passed([6.0, 6.0]) == 1  # one unit came back, not a window's worth
    assert key.report(18.0)[0] == 2
    assert key.report(100.0)[:3] == (3, 0.0, 0.0)  # whole again: nothing to wait for


def test_a_cost_above_what_is_left_is_refused_and_consumes_nothing() -> None:
    for tag in (FIXED, SLIDING, GCRA):
        key = Key(tag, 5, 60.0)
        assert key.hit(0.0, cost=4)
        assert not key.hit(0.0, cost=2)
        assert key.hit(0.0, cost=1)
        assert not key.hit(0.0, cost=6)  # more than the amount: never fits
        assert key.hit(0.0, cost=0)  # nothing left, and nothing asked


def test_settles_charge_debts_and_refund_only_a_window_that_is_current() -> None:
    window = 60.0
    # Fixed: a refund into the reservation's window; a debt into whatever window is current.
    assert settle(FIXED, (5, 0, 0.0), 10.0, -3, 0.0, 5, window) == (2, 0, 0.0)
    assert settle(FIXED, (0, 0, 60.0), 61.0, -3, 0.0, 5, window) is None
    assert settle(FIXED, (1, 0, 60.0), 61.0, 4, 0.0, 5, window) == (5, 0, 60.0)
    # A balance may go past the amount (then requests are refused until it refills).
    assert settle(FIXED, (5, 0, 0.0), 10.0, 7, 0.0, 5, window) == (12, 0, 0.0)
    # Sliding: the reservation's window may now be the previous one.
    assert settle(SLIDING, (1, 5, 60.0), 61.0, -2, 0.0, 5, window) == (1, 3, 60.0)
    # Gcra: a refund never takes the bucket above whole.
    assert settle(GCRA, (0, 0, 130.0), 100.0, -2, 0.0, 5, window) == (0, 0, 106.0)
    assert settle(GCRA, (0, 0, 130.0), 100.0, -9, 0.0, 5, window) == (0, 0, 100.0)
    assert settle(GCRA, (0, 0, 100.0), 100.0, -1, 0.0, 5, window) is None
    assert settle(GCRA, (0, 0, 100.0), 100.0, 2, 0.0, 5, window) == (0, 0, 124.0)
    # Nothing settled, nothing written (not even an elapsed window's roll).
    for tag in (FIXED, SLIDING, GCRA):
        assert settle(tag, (1, 1, 0.0), 100.0, 0, 0.0, 5, window) is None
