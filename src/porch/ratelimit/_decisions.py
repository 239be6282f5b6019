"""A rate-limit decision as the client sees it: the headers, and the refusal if refused.

Shared by decisions the store takes and refusals answered from memory
(:mod:`porch.ratelimit._refusals`), so both say the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..errors import ConfigurationError
from ..store.base import Algorithm, Hit
from ._refusals import Remembered
from ._rules import CLIENT, GLOBAL, Limit, Rule

__all__ = [
    "HEADER_STYLES",
    "CompiledRule",
    "HeaderStyle",
    "PolicyState",
    "Refusal",
    "check_header_style",
    "decide",
    "level_key",
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
    """One limit's state after a decision (the policy a client is told: ``limit`` units per
    ``window`` seconds; for gcra its burst per full refill; for a concurrency cap,
    ``limit`` requests in flight, ``window`` 0 and ``unit`` ``"concurrent-requests"``) and
    the level it counts under."""

    name: str
    limit: int
    window: float
    remaining: int
    reset_after: int  # whole seconds until more units are available, >= 1
    unit: str = "requests"
    level: str = CLIENT


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refusal factory is told: the client key, violated policies and the retry delay,
    and the rate-limit headers the refusal is answered with (``Retry-After`` included)."""

    key: str
    violated: tuple[PolicyState, ...]
    retry_after: int
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def level(self) -> str:
        """The level that refused: the first violated policy's (``"client"``, ``"global"``,
        or a level the rule declares)."""
        return self.violated[0].level if self.violated else CLIENT


class CompiledRule:
    """A rule with everything per-request precomputed (header bytes included).

    A rule with plans has one per plan (``variants``), and one per set of levels a
    request leaves out (``subset``); each counts the rule's limits it holds.
    """

    __slots__ = (
        "algorithms",
        "amounts",
        "bursts",
        "caps",
        "chosen",
        "counters",
        "level_keys",
        "level_names",
        "levels",
        "limit_bytes",
        "limit_header",
        "limits",
        "names",
        "plain",
        "plan",
        "policy_header",
        "policy_pair",
        "prefixes",
        "quotas",
        "rule",
        "simple",
        "sliced",
        "slot_caps",
        "slot_names",
        "slot_prefixes",
        "slot_status",
        "spans",
        "status_prefixes",
        "style",
        "subsets",
        "variants",
        "windows",
    )

    def __init__(
        self,
        rule: Rule,
        headers: HeaderStyle = "both",
        limits: tuple[Limit, ...] | None = None,
        plan: str | None = None,
    ) -> None:
        self.rule = rule
        self.style: HeaderStyle = headers
        # (allowed, refused) metric counters, bound once when metrics are configured.
        self.counters: tuple[Any, Any] | None = None
        own = limits is None
        limits = rule.limits if limits is None else limits
        self.limits: tuple[Limit, ...] = limits
        self.plan = plan  # the plan whose limits these are (None: the rule's own)
        self.amounts = tuple(limit.amount for limit in limits)
        self.windows = tuple(float(limit.window) for limit in limits)
        # What a Hit carries: None when every limit is a fixed window (the stores' fast
        # path), and bursts only where some differ from the amounts.
        every: tuple[Algorithm, ...] = tuple(limit.algorithm for limit in limits)
        self.algorithms = None if all(a == "fixed" for a in every) else every
        bursts = tuple(limit.burst for limit in limits)
        self.bursts = None if bursts == self.amounts else bursts
        self.levels = tuple(limit.level for limit in limits)
        # Each level once, in order: the keys a request's hit needs.
        self.level_names = tuple(dict.fromkeys(self.levels))
        self.level_keys = dict(rule.levels)  # the declared levels' key functions
        # The limits a host decides from slices it leases (Limit(slice=...)), by index.
        self.sliced = tuple(j for j, limit in enumerate(limits) if limit.slice is not None)
        # Today's shape: one key (the client's), one unit, nothing to settle, no plans, no
        # concurrency caps. The middleware's hot path takes only these; the rest, _policy.
        self.plain = (
            type(rule.cost) is int
            and rule.cost == 1
            and not rule.settle
            and rule.plans is None
            and not rule.concurrency
            and self.level_names == (CLIENT,)
            and not self.sliced
        )
        # The policy each limit announces: q units per w seconds (gcra: its burst per
        # full refill, ceil(B * T)).
        self.quotas = tuple(
            limit.burst if limit.algorithm == "gcra" else limit.amount for limit in limits
        )
        self.spans = tuple(
            limit.burst * (float(limit.window) / limit.amount)
            if limit.algorithm == "gcra"
            else float(limit.window)
            for limit in limits
        )
        # ceil: never tell a client a window ends earlier than it does. A store's
        # ``end - now`` can come out a rounding error above the window (a fresh window
        # read as 60.000000000001 s), and ceil would then add a whole second: no fixed
        # window has more than its length left. The other algorithms' times are not
        # bounded by their window (a settled debt), so they are not capped.
        self.caps = tuple(
            float(limit.window) if limit.algorithm == "fixed" else math.inf for limit in limits
        )
        self.names = tuple(limit.name for limit in limits)
        self.prefixes = tuple(f"rl\x1f{rule.name}\x1f{limit.name}\x1f" for limit in limits)
        self.limit_bytes = tuple(str(q).encode("ascii") for q in self.quotas)
        self.status_prefixes = tuple(f'"{limit.name}";r='.encode("ascii") for limit in limits)
        # Concurrency caps (Concurrency): a slot key per cap, taken with the hit; the
        # client's, whatever the plan or the levels.
        concurrency = rule.concurrency
        self.slot_names = tuple(cap.name for cap in concurrency)
        self.slot_caps = tuple(cap.amount for cap in concurrency)
        self.slot_prefixes = tuple(f"rl\x1f{rule.name}\x1f{cap.name}\x1f" for cap in concurrency)
        self.slot_status = tuple(f'"{cap.name}";r='.encode("ascii") for cap in concurrency)
        # One rate limit, no cap: decide()'s fast path.
        self.simple = len(limits) == 1 and not concurrency
        self.policy_header = ", ".join(
            [
                f'"{limit.name}";q={q};w={math.ceil(span)}'
                for limit, q, span in zip(limits, self.quotas, self.spans, strict=True)
            ]
            + [f'"{cap.name}";q={cap.amount};qu="concurrent-requests"' for cap in concurrency]
        ).encode("ascii")
        # The two headers that never change for a one-limit rule, built once.
        self.limit_header = (b"x-ratelimit-limit", self.limit_bytes[0] if limits else b"")
        self.policy_pair = (b"ratelimit-policy", self.policy_header)
        # A rule with plans: each plan's limits compiled alike, by plan name.
        self.variants: dict[str, CompiledRule] = {}
        if own and rule.plans is not None:
            self.variants = {
                name: CompiledRule(rule, headers, found, name) for name, found in rule.plans.plans
            }
        # What was compiled for the levels a request left out, by the levels kept.
        self.subsets: dict[tuple[bool, ...], CompiledRule | None] = {}
        # A rule with plans: each client's plan and until when it holds (monotonic s).
        self.chosen: dict[str, tuple[CompiledRule, float]] = {}

    def hit(self, keys: list[str], cost: int = 1, slots: list[str] | None = None) -> Hit:
        """A hit of ``cost`` units on ``keys`` (one per limit) under this rule, taking a slot
        of each of ``slots`` (one per concurrency cap)."""
        if slots is None:
            return Hit(keys, self.amounts, self.windows, self.algorithms, self.bursts, cost)
        return Hit(
            keys,
            self.amounts,
            self.windows,
            self.algorithms,
            self.bursts,
            cost,
            slots,
            self.slot_caps,
        )

    def subset(self, kept: tuple[bool, ...]) -> CompiledRule | None:
        """This rule's limits for a request some of whose levels do not apply (``kept``, per
        limit); None when none is left."""
        found = self.subsets.get(kept, self)
        if found is self:
            limits = tuple(limit for limit, keep in zip(self.limits, kept, strict=True) if keep)
            found = (
                CompiledRule(self.rule, self.style, limits, self.plan)
                if limits or self.slot_caps
                else None
            )
            if found is not None:
                found.counters = self.counters
            self.subsets[kept] = found
        return found


def level_key(level: str, client: str) -> str | None:
    """The key of a built-in level for a request of ``client`` (None: a declared level)."""
    if level == CLIENT:
        return client
    if level == GLOBAL:
        return ""  # everyone: the constant empty client
    return None


def remembered_hit(
    entry: Remembered, keys: list[str], compiled: CompiledRule, now: float, wall: float
) -> Hit:
    """A refusal answered from memory, as the store would decide it now (allowed=False)."""
    hit = compiled.hit(keys, entry.cost)
    hit.fits = entry.fits
    hit.remaining = entry.remaining
    hit.next = [max(0.0, end - now) for end in entry.nexts]
    hit.full = [max(0.0, end - now) for end in entry.fulls]
    hit.retry = [max(0.0, end - now) for end in entry.retries]
    hit.stamp = entry.stamps
    hit.in_flight = entry.in_flight
    hit.wall = wall
    return hit


def decide(
    compiled: CompiledRule, hit: Hit, client: str
) -> tuple[list[tuple[bytes, bytes]], Refusal | None]:
    """The response headers for a decision, and the refusal if the hit was refused."""
    if hit.allowed and compiled.simple:
        # The common case: one limit, no choosing, no refusal. Once per request, so
        # it reads each input once and formats each number once.
        cap = compiled.caps[0]
        reset = hit.next[0]
        reset = reset if reset < cap else cap
        full = hit.full[0]
        full = full if full < cap else cap
        left = hit.remaining[0]
        style = compiled.style
        if style == "x-ratelimit":
            return [
                compiled.limit_header,
                (b"x-ratelimit-remaining", b"%d" % left),
                (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + full)),
            ], None
        if style == "none":
            return [], None
        status = compiled.status_prefixes[0] + b"%d;t=%d" % (left, _ceil(reset) or 1)
        if style == "ietf":
            return [compiled.policy_pair, (b"ratelimit", status)], None
        return [
            compiled.limit_header,
            (b"x-ratelimit-remaining", b"%d" % left),
            (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + full)),
            compiled.policy_pair,
            (b"ratelimit", status),
        ], None
    if compiled.slot_caps:
        return _decide_holding(compiled, hit, client)
    caps = compiled.caps
    n = len(caps)
    remaining = hit.remaining
    t = [_ceil(r if r < c else c) or 1 for r, c in zip(hit.next, caps, strict=True)]
    if n == 1:
        i = 0
        status = compiled.status_prefixes[0] + b"%d;t=%d" % (remaining[0], t[0])
    else:
        # X-RateLimit-* describe the tightest limit: least remaining, then latest reset (the
        # first of equals). A loop, not min() with a key: once per request of a rule with
        # levels or several limits, where a key function's calls cost more than the rest.
        i = 0
        for j in range(1, n):
            if remaining[j] < remaining[i] or (remaining[j] == remaining[i] and t[j] > t[i]):
                i = j
        prefixes = compiled.status_prefixes
        status = b", ".join([prefixes[j] + b"%d;t=%d" % (remaining[j], t[j]) for j in range(n)])
    headers: list[tuple[bytes, bytes]] = []
    if compiled.style in ("both", "x-ratelimit"):
        headers += [
            (b"x-ratelimit-limit", compiled.limit_bytes[i]),
            (b"x-ratelimit-remaining", b"%d" % remaining[i]),
            (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + min(hit.full[i], caps[i]))),
        ]
    if compiled.style in ("both", "ietf"):
        headers += [compiled.policy_pair, (b"ratelimit", status)]
    if hit.allowed:
        return headers, None
    fits = hit.fits
    violated = [j for j in range(n) if not fits[j]] or list(range(n))
    # Retry-After: the earliest time this request could fit, never before a violated
    # policy's RateLimit t (a client told "t=5" is not told to come back in 3).
    retry_after = max(max(t[j], _ceil(min(hit.retry[j], caps[j])) or 1) for j in violated)
    headers.append((b"retry-after", b"%d" % retry_after))
    policies = tuple(
        PolicyState(
            compiled.names[j],
            compiled.quotas[j],
            compiled.spans[j],
            remaining[j],
            t[j],
            level=compiled.levels[j],
        )
        for j in violated
    )
    return headers, Refusal(client, policies, retry_after, tuple(headers))


def _decide_holding(
    compiled: CompiledRule, hit: Hit, client: str
) -> tuple[list[tuple[bytes, bytes]], Refusal | None]:
    """:func:`decide` for a rule with concurrency caps (and any number of rate limits).

    The draft's fields list every policy, the caps last (``r``: slots free, ``t`` 1: when
    one frees is unknown); ``X-RateLimit-*`` describe the tightest rate limit (none for a
    rule of caps only: a cap has no window to report). A refusal names what refused: the
    rate limits that had no room and the caps that had no free slot; ``Retry-After`` is
    1 for a cap."""
    caps = compiled.caps
    n = len(caps)
    remaining = hit.remaining
    slot_caps = compiled.slot_caps
    in_flight = hit.in_flight or [0] * len(slot_caps)
    if hit.allowed and n == 1 and len(slot_caps) == 1:
        # The common case (one rate limit, one cap, allowed), as decide()'s fast path.
        cap = caps[0]
        reset = hit.next[0]
        t0 = _ceil(reset if reset < cap else cap) or 1
        left = remaining[0]
        spare = slot_caps[0] - in_flight[0]
        style = compiled.style
        quick: list[tuple[bytes, bytes]] = []
        if style == "both" or style == "x-ratelimit":
            whole = hit.full[0]
            quick = [
                compiled.limit_header,
                (b"x-ratelimit-remaining", b"%d" % left),
                (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + (whole if whole < cap else cap))),
            ]
        if style == "both" or style == "ietf":
            status = b"%s%d;t=%d, %s%d;t=1" % (
                compiled.status_prefixes[0],
                left,
                t0,
                compiled.slot_status[0],
                spare if spare > 0 else 0,
            )
            quick += [compiled.policy_pair, (b"ratelimit", status)]
        return quick, None
    t = [_ceil(min(r, c)) or 1 for r, c in zip(hit.next, caps, strict=True)]
    free = [cap - f if f < cap else 0 for cap, f in zip(slot_caps, in_flight, strict=True)]
    status = b", ".join(
        [compiled.status_prefixes[j] + b"%d;t=%d" % (remaining[j], t[j]) for j in range(n)]
        + [
            prefix + b"%d;t=1" % left
            for prefix, left in zip(compiled.slot_status, free, strict=True)
        ]
    )
    headers: list[tuple[bytes, bytes]] = []
    if n and compiled.style in ("both", "x-ratelimit"):
        i = min(range(n), key=lambda j: (remaining[j], -t[j]))
        headers += [
            (b"x-ratelimit-limit", compiled.limit_bytes[i]),
            (b"x-ratelimit-remaining", b"%d" % remaining[i]),
            (b"x-ratelimit-reset", b"%d" % _ceil(hit.wall + min(hit.full[i], caps[i]))),
        ]
    if compiled.style in ("both", "ietf"):
        headers += [compiled.policy_pair, (b"ratelimit", status)]
    if hit.allowed:
        return headers, None
    fits = hit.fits
    rates = [j for j in range(n) if not fits[j]]
    # A hit a rate limit refused took no slot: its caps are reported as they stand.
    full = [k for k in range(len(slot_caps)) if in_flight[k] >= slot_caps[k]]
    if not rates and not full:  # (a refusal the store reported without a reason)
        rates = list(range(n))
        full = list(range(len(slot_caps)))
    retry_after = max(
        [max(t[j], _ceil(min(hit.retry[j], caps[j])) or 1) for j in rates] + [1] * bool(full)
    )
    headers.append((b"retry-after", b"%d" % retry_after))
    levels = compiled.levels
    policies = tuple(
        PolicyState(
            compiled.names[j],
            compiled.quotas[j],
            compiled.spans[j],
            remaining[j],
            t[j],
            level=levels[j],
        )
        for j in rates
    ) + tuple(
        # A cap counts the client's requests in flight: the client's level.
        PolicyState(compiled.slot_names[k], slot_caps[k], 0.0, free[k], 1, "concurrent-requests")
        for k in full
    )
    return headers, Refusal(client, policies, retry_after, tuple(headers))
