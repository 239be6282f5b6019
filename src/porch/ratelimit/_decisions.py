"""A rate-limit decision as the client sees it: the headers, and the refusal if refused.

Shared by decisions the store takes and refusals answered from memory
(:mod:`porch.ratelimit._refusals`), so both say the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..errors import ConfigurationError
from ..store.base import Hit
from ._refusals import Remembered
from ._rules import Limit, Rule

__all__ = [
    "HEADER_STYLES",
    "CompiledRule",
    "HeaderStyle",
    "PolicyState",
    "Refusal",
    "check_header_style",
    "decide",
    "remembered_hit",
]

_ceil = math.ceil  # a global, not an attribute load per call on the hot path

# Which rate-limit fields a response carries: the IETF draft's ``RateLimit-Policy`` and
# ``RateLimit``, the de-facto ``X-RateLimit-Limit/-Remaining/-Reset``, both, or none.
# A refusal carries ``Retry-After`` whatever the style: it is HTTP's own.
HeaderStyle = Literal["both", "ietf", "x-ratelimit", "none"]
HEADER_STYLES: tuple[HeaderStyle, ...] = get_args(HeaderStyle)


def check_header_style(headers: object) -> None:
    """Raise ConfigurationError unless ``headers`` is one of HEADER_STYLES."""
    if headers not in HEADER_STYLES:
        raise ConfigurationError(f"headers must be one of {HEADER_STYLES}, got {headers!r}")


@dataclass(frozen=True, slots=True)
class PolicyState:
    """One limit's state after a decision."""

    name: str
    limit: int
    window: float
    remaining: int
    reset_after: int  # whole seconds until the window ends, >= 1


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refusal factory is told: the client key, violated policies and the retry delay,
    and the rate-limit headers the refusal is answered with (``Retry-After`` included)."""

    key: str
    violated: tuple[PolicyState, ...]
    retry_after: int
    headers: tuple[tuple[bytes, bytes], ...] = ()


class CompiledRule:
    """A rule with everything per-request precomputed (header bytes included)."""

    __slots__ = (
        "amounts",
        "counters",
        "limit_bytes",
        "limit_header",
        "limits",
        "names",
        "policy_header",
        "policy_pair",
        "prefixes",
        "rule",
        "status_prefixes",
        "style",
        "windows",
    )

    def __init__(self, rule: Rule, headers: HeaderStyle = "both") -> None:
        self.rule = rule
        self.style: HeaderStyle = headers
        # (allowed, refused) metric counters, bound once when metrics are configured.
        self.counters: tuple[Any, Any] | None = None
        self.limits: tuple[Limit, ...] = rule.limits
        self.amounts = tuple(limit.amount for limit in rule.limits)
        self.windows = tuple(float(limit.window) for limit in rule.limits)
        self.names = tuple(limit.name for limit in rule.limits)
        self.prefixes = tuple(f"rl\x1f{rule.name}\x1f{limit.name}\x1f" for limit in rule.limits)
        self.limit_bytes = tuple(str(limit.amount).encode("ascii") for limit in rule.limits)
        self.status_prefixes = tuple(f'"{limit.name}";r='.encode("ascii") for limit in rule.limits)
        self.policy_header = ", ".join(
            f'"{limit.name}";q={limit.amount};w={math.ceil(limit.window)}' for limit in rule.limits
        ).encode("ascii")
        # The two headers that never change for a one-limit rule, built once.
        self.limit_header = (b"x-ratelimit-limit", self.limit_bytes[0])
        self.policy_pair = (b"ratelimit-policy", self.policy_header)


def remembered_hit(
    entry: Remembered, keys: list[str], compiled: CompiledRule, now: float, wall: float
) -> Hit:
    """A refusal answered from memory, as the store would decide it now (allowed=False)."""
    hit = Hit(keys, compiled.amounts, compiled.windows)
    hit.counts = entry.counts
    hit.resets = [max(0.0, end - now) for end in entry.ends]
    hit.wall = wall
    return hit


def decide(
    compiled: CompiledRule, hit: Hit, client: str
) -> tuple[list[tuple[bytes, bytes]], Refusal | None]:
    """The response headers for a decision, and the refusal if the hit was refused."""
    # ceil: never tell a client a window ends earlier than it does. A store's
    # ``end - now`` can come out a rounding error above the window (a fresh
    # window read as 60.000000000001 s), and ceil would then add a whole second:
    # no window has more than its length left.
    if hit.allowed and len(compiled.amounts) == 1:
        # The common case: one limit, no choosing, no refusal. Once per request, so
        # it reads each input once and formats each number once.
        reset = hit.resets[0]
        window = compiled.windows[0]
        reset = reset if reset < window else window
        left = compiled.amounts[0] - hit.counts[0]
        style = compiled.style
        if style == "x-ratelimit":
            return [
                compiled.limit_header,
                (b"x-ratelimit-remaining", b"%d" % left),
                (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + reset)),
            ], None
        if style == "none":
            return [], None
        status = compiled.status_prefixes[0] + b"%d;t=%d" % (left, _ceil(reset) or 1)
        if style == "ietf":
            return [compiled.policy_pair, (b"ratelimit", status)], None
        return [
            compiled.limit_header,
            (b"x-ratelimit-remaining", b"%d" % left),
            (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + reset)),
            compiled.policy_pair,
            (b"ratelimit", status),
        ], None
    amounts = compiled.amounts
    counts = hit.counts
    windows = compiled.windows
    n = len(amounts)
    resets = [min(r, w) for r, w in zip(hit.resets, windows, strict=True)]
    if n == 1:
        i = 0
        remaining = [amounts[0] - counts[0] if counts[0] < amounts[0] else 0]
        t = [math.ceil(resets[0]) or 1]
        status = compiled.status_prefixes[0] + b"%d;t=%d" % (remaining[0], t[0])
    else:
        remaining = [max(0, amounts[j] - counts[j]) for j in range(n)]
        t = [max(1, math.ceil(r)) for r in resets]
        # X-RateLimit-* describe the tightest limit: least remaining, then latest reset.
        i = min(range(n), key=lambda j: (remaining[j], -t[j]))
        status = b", ".join(
            compiled.status_prefixes[j] + b"%d;t=%d" % (remaining[j], t[j]) for j in range(n)
        )
    headers: list[tuple[bytes, bytes]] = []
    if compiled.style in ("both", "x-ratelimit"):
        headers += [
            (b"x-ratelimit-limit", compiled.limit_bytes[i]),
            (b"x-ratelimit-remaining", b"%d" % remaining[i]),
            (b"x-ratelimit-reset", b"%d" % math.ceil(hit.wall + resets[i])),
        ]
    if compiled.style in ("both", "ietf"):
        headers += [compiled.policy_pair, (b"ratelimit", status)]
    if hit.allowed:
        return headers, None
    violated = tuple(
        PolicyState(compiled.names[j], amounts[j], compiled.windows[j], 0, t[j])
        for j in range(n)
        if counts[j] >= amounts[j]
    )
    retry_after = max(p.reset_after for p in violated)
    headers.append((b"retry-after", b"%d" % retry_after))
    return headers, Refusal(client, violated, retry_after, tuple(headers))
