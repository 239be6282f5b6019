from __future__ import annotations

import pytest

from porch import Limit, Rule
from porch.ratelimit._decisions import HEADER_STYLES, CompiledRule, HeaderStyle, decide
from porch.store.base import Hit


def _hit(compiled: CompiledRule, counts: list[int], resets: list[float], allowed: bool) -> Hit:
    hit = Hit(["k"] * len(counts), compiled.amounts, compiled.windows)
    hit.allowed = allowed
    hit.counts = counts
    hit.resets = resets
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
