"""The policies of docs/design.md ("Policies") in plain Python: the conformance suite's reference.

Written from the spec's text, not from porch: nothing here imports porch, so a
mistake in porch's arithmetic cannot hide in the model too. Every number is an
IEEE double computed in the spec's order; the suite compares a store's verdicts
and reports with the model's to the bit.

The model holds one record per counter key (``n``, ``p``, ``s``, ``e`` and the
algorithm's tag), reads an absent, expired or other algorithm's record as
absent, writes only what an allowed hit or a settle that acts writes, and
answers with what the seam's ``Hit`` carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["EPS", "Model", "Policy", "Record", "Report"]

EPS = 1e-9
TAG = {"fixed": 0, "sliding": 1, "gcra": 2}


@dataclass(frozen=True)
class Policy:
    """One limit of a rule: where it counts and how."""

    key: str
    algorithm: str
    amount: int  # A
    window: float  # W
    burst: int  # B (gcra)


@dataclass
class Record:
    """What the store keeps for one counter key."""

    a: int  # the algorithm's tag
    n: int = 0
    p: int = 0
    s: float = 0.0
    e: float = 0.0


@dataclass
class Report:
    """What a hit answers: the verdict and, per limit, what the seam's Hit carries."""

    allowed: bool
    fits: list[bool] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    next: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    retry: list[float] = field(default_factory=list)
    stamp: list[float] = field(default_factory=list)


class Model:
    """Every counter key's record, changed only as the spec says."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}

    def _live(self, policy: Policy, t: float) -> Record | None:
        record = self.records.get(policy.key)
        if record is None or record.a != TAG[policy.algorithm] or t >= record.e:
            return None  # absent, another algorithm's, or expired: read as absent
        return record

    # -- reading ---------------------------------------------------------------------

    def _read(self, policy: Policy, t: float) -> Record:
        """The record as a hit at ``t`` sees it (a copy: a refusal writes nothing)."""
        live = self._live(policy, t)
        W = policy.window
        if policy.algorithm == "fixed":
            if live is None or t >= live.s + W:
                return Record(0, n=0, s=t)
            return Record(0, n=live.n, s=live.s)
        if policy.algorithm == "sliding":
            if live is None:
                return Record(1, p=0, n=0, s=t)
            if t >= live.s + 2 * W:
                return Record(1, p=0, n=0, s=t)
            if t >= live.s + W:
                return Record(1, p=live.n, n=0, s=live.s + W)
            return Record(1, p=live.p, n=live.n, s=live.s)
        tat = t if live is None else max(live.s, t)
        return Record(2, s=tat)

    def _write(self, policy: Policy, state: Record) -> None:
        W = policy.window
        if policy.algorithm == "fixed":
            state.e = state.s + W
        elif policy.algorithm == "sliding":
            state.e = state.s + 2 * W
        else:
            state.e = state.s
        self.records[policy.key] = state

    # -- deciding --------------------------------------------------------------------

    @staticmethod
    def _fits(policy: Policy, state: Record, t: float, c: int) -> bool:
        A, W = policy.amount, policy.window
        if policy.algorithm == "fixed":
            return state.n + c <= A
        if policy.algorithm == "sliding":
            w = (W - (t - state.s)) / W
            est = state.p * w + state.n
            return est + c <= A + EPS
        T = W / A
        tau = T * policy.burst
        return (state.s - t) + c * T <= tau + EPS * T

    @staticmethod
    def _charge(policy: Policy, state: Record, c: int) -> None:
        if policy.algorithm == "gcra":
            state.s = state.s + c * (policy.window / policy.amount)
        else:
            state.n += c

    @staticmethod
    def _report(
        policy: Policy, state: Record, t: float, c: int
    ) -> tuple[int, float, float, float, float]:
        A, W = policy.amount, policy.window
        if policy.algorithm == "fixed":
            end = state.s + W
            return max(0, A - state.n), end - t, end - t, end - t, state.s
        if policy.algorithm == "sliding":
            p, n, s = state.p, state.n, state.s
            w = (W - (t - s)) / W
            est = p * w + n

            def until(x: int) -> float:
                if p * w + n <= x + EPS:
                    return 0.0
                left = s + W - t
                if n <= x + EPS:
                    return (W - (t - s)) - (x - n) * W / p
                if x < 0:
                    return left + W
                return left + W * (n - x) / n

            remaining = min(A, max(0, math.floor(A - est + EPS)))
            return (
                remaining,
                until(A - remaining - 1) if remaining < A else 0.0,
                until(0),
                until(A - c),
                s,
            )
        B = policy.burst
        T = W / A
        tau = T * B
        level = max(0.0, state.s - t)
        remaining = min(B, max(0, math.floor((tau - level) / T + EPS)))
        return (
            remaining,
            max(0.0, level - (B - remaining - 1) * T) if remaining < B else 0.0,
            level,
            max(0.0, level + c * T - tau),
            0.0,
        )

    def hit(self, policies: list[Policy], c: int, t: float) -> Report:
        """One request of cost ``c`` against every policy, all or nothing, at ``t``."""
        states = [self._read(policy, t) for policy in policies]
        fits = [self._fits(policy, st, t, c) for policy, st in zip(policies, states, strict=True)]
        allowed = all(fits)
        if allowed:
            for policy, st in zip(policies, states, strict=True):
                self._charge(policy, st, c)
                self._write(policy, Record(st.a, n=st.n, p=st.p, s=st.s))
        report = Report(allowed, fits)
        for policy, st in zip(policies, states, strict=True):
            remaining, nxt, full, retry, stamp = self._report(policy, st, t, c)
            report.remaining.append(remaining)
            report.next.append(nxt)
            report.full.append(full)
            report.retry.append(retry)
            report.stamp.append(stamp)
        return report

    # -- settling --------------------------------------------------------------------

    def settle(self, policies: list[Policy], delta: int, stamps: list[float], t: float) -> None:
        """Charge (``delta`` > 0) or refund (< 0) a hit's policies at ``t``; never refuses."""
        if delta == 0:
            return  # nothing to settle: nothing is written, not even a roll
        for policy, stamp in zip(policies, stamps, strict=True):
            st = self._read(policy, t)
            if policy.algorithm == "fixed":
                if st.s == stamp:
                    st.n = max(0, st.n + delta)
                elif delta > 0:
                    st.n += delta  # a debt follows the client into the current window
                else:
                    continue  # a refund to a window that has gone
            elif policy.algorithm == "sliding":
                if st.s == stamp:
                    st.n = max(0, st.n + delta)
                elif st.s == stamp + policy.window:
                    st.p = max(0, st.p + delta)
                elif delta > 0:
                    st.n += delta
                else:
                    continue
            else:
                T = policy.window / policy.amount
                if delta > 0:
                    st.s = max(st.s, t) + delta * T
                elif st.s > t:
                    st.s = max(t, st.s + delta * T)
                else:
                    continue  # a refund to a full bucket
            self._write(policy, st)
