from __future__ import annotations

import pytest

from porch import Limit, Rule
from porch.ratelimit._decisions import HEADER_STYLES, CompiledRule, HeaderStyle, decide
from porch.store.base import Hit


def _hit(compiled: CompiledRule, counts: list[int], resets: list[float], allowed: bool) -> Hit:
    """A fixed-window decision as a store reports it: windows at these counts, ending in
    ``resets`` seconds."""
    hit = Hit(["k"] * len(counts), compiled.amounts, compiled.windows)
    hit.allowed = allowed
    hit.fits = [c + 1 <= a for c, a in zip(counts, compiled.amounts, strict=True)]
    hit.remaining = [max(0, a - c) for c, a in zip(counts, compiled.amounts, strict=True)]
    hit.next = hit.full = hit.retry = resets
    hit.stamp = [0.0] * len(counts)
    hit.wall = 1_700_000_000.0
    return hit


@pytest.mark.parametrize("allowed", [True, False])
def test_a_reset_a_rounding_error_above_the_window_is_the_window(allowed: bool) -> None:
    # (now + 60) - now on a store's clock can be 60.000000000007: never t=61 for a 60 s window.
    compiled = CompiledRule(Rule(Limit(10, 60, name="demo")))
    hit = _hit(compiled, [1 if allowed else 10], [60.0 + 7e-12], allowed)
    headers, refusal = decide(compiled, hit, "c")
    values = dict(headers)
    assert values[b"ratelimit"] == (b'"demo";r=9;t=60' if allowed else b'"demo";r=0;t=60')
    assert values[b"x-ratelimit-reset"] == b"1700000060"
    if not allowed:
        assert refusal is not None
        assert refusal.retry_after == 60


def test_several_limits_are_each_clamped_to_their_window() -> None:
    compiled = CompiledRule(Rule([Limit(2, 1, name="s"), Limit(5, 60, name="m")]))
    hit = _hit(compiled, [2, 2], [1.0 + 1e-12, 60.0 + 1e-11], False)
    headers, refusal = decide(compiled, hit, "c")
    assert dict(headers)[b"ratelimit"] == b'"s";r=0;t=1, "m";r=3;t=60'
    assert refusal is not None
    assert refusal.retry_after == 1


X_FIELDS = {b"x-ratelimit-limit", b"x-ratelimit-remaining", b"x-ratelimit-reset"}
IETF_FIELDS = {b"ratelimit-policy", b"ratelimit"}
SENT = {"both": X_FIELDS | IETF_FIELDS, "ietf": IETF_FIELDS, "x-ratelimit": X_FIELDS, "none": set()}


@pytest.mark.parametrize("style", HEADER_STYLES)
@pytest.mark.parametrize(
    ("limits", "counts", "allowed"),
    [
        ([Limit(10, 60, name="a")], [3], True),  # the one-limit fast path
        ([Limit(10, 60, name="a")], [10], False),
        ([Limit(2, 1, name="s"), Limit(5, 60, name="m")], [1, 4], True),
        ([Limit(2, 1, name="s"), Limit(5, 60, name="m")], [2, 4], False),
    ],
)
def test_each_header_style_sends_its_fields_with_the_values_of_both(
    style: HeaderStyle, limits: list[Limit], counts: list[int], allowed: bool
) -> None:
    resets = [0.5 * limit.window for limit in limits]
    full = CompiledRule(Rule(limits, name="r"))
    compiled = CompiledRule(Rule(limits, name="r"), style)
    everything, _ = decide(full, _hit(full, counts, resets, allowed), "c")
    headers, refusal = decide(compiled, _hit(compiled, counts, resets, allowed), "c")
    expected = SENT[style] | ({b"retry-after"} if not allowed else set())
    assert [name for name, _ in headers] == [n for n, _ in everything if n in expected]
    assert set(headers) <= set(everything)  # the same values, fewer fields
    assert (refusal is None) == allowed
    if refusal is not None:
        assert refusal.headers == tuple(headers)
        assert dict(headers)[b"retry-after"] == dict(everything)[b"retry-after"]


def _report(
    compiled: CompiledRule,
    *,
    allowed: bool,
    fits: list[bool],
    remaining: list[int],
    next: list[float],
    full: list[float],
    retry: list[float],
) -> Hit:
    hit = compiled.hit(["k"] * len(fits), cost=3)
    hit.allowed = allowed
    hit.fits, hit.remaining = fits, remaining
    hit.next, hit.full, hit.retry = next, full, retry
    hit.stamp = [0.0] * len(fits)
    hit.wall = 1_700_000_000.0
    return hit


def test_a_gcra_limit_announces_its_burst_per_full_refill() -> None:
    # 10 per minute is one per 6 s: a bucket of 5 refills in 30 s.
    compiled = CompiledRule(Rule(Limit(10, 60, name="b", algorithm="gcra", burst=5)))
    assert compiled.policy_header == b'"b";q=5;w=30'
    assert compiled.algorithms == ("gcra",)
    assert compiled.bursts == (5,)
    hit = _report(
        compiled, allowed=True, fits=[True], remaining=[2], next=[4.5], full=[16.5], retry=[0.0]
    )
    values = dict(decide(compiled, hit, "c")[0])
    assert values[b"ratelimit"] == b'"b";r=2;t=5'
    assert values[b"x-ratelimit-limit"] == b"5"
    assert values[b"x-ratelimit-reset"] == b"1700000017"  # when the bucket is whole again


def test_a_fixed_rule_sends_no_algorithms_so_stores_keep_their_fast_path() -> None:
    compiled = CompiledRule(Rule([Limit(10, 60), Limit(5, 1)]))
    assert (compiled.algorithms, compiled.bursts) == (None, None)
    hit = compiled.hit(["a", "b"])
    assert (hit.algorithms, hit.bursts, hit.cost) == (None, None, 1)


def test_retry_after_is_when_the_request_fits_and_never_before_a_violated_t() -> None:
    # A sliding limit with a unit left, refusing a request of 3: more units in 2.5 s,
    # enough for this request in 7.2 s. The other limit fits (it is not violated).
    compiled = CompiledRule(
        Rule([Limit(10, 60, name="s", algorithm="sliding"), Limit(100, 3600, name="h")])
    )
    hit = _report(
        compiled,
        allowed=False,
        fits=[False, True],
        remaining=[1, 4],
        next=[2.5, 3000.0],
        full=[70.0, 3000.0],
        retry=[7.2, 3000.0],
    )
    headers, refusal = decide(compiled, hit, "c")
    values = dict(headers)
    assert values[b"ratelimit"] == b'"s";r=1;t=3, "h";r=4;t=3000'
    assert values[b"retry-after"] == b"8"
    assert refusal is not None
    assert refusal.retry_after == 8
    assert [(p.name, p.remaining, p.reset_after) for p in refusal.violated] == [("s", 1, 3)]
    # Never before the RateLimit t of a violated policy, whatever its retry says.
    hit.retry = [0.4, 3000.0]
    headers, refusal = decide(compiled, hit, "c")
    assert refusal is not None
    assert refusal.retry_after == 3
