"""Rate-limit configuration: limits (numbers or rate strings), and the rules that select requests.

A rule's ``name`` is the namespace of its counters in the store (the key of a
client's counter is rule name + limit name + client). Left out, it is derived
from the rule's path and methods, so two rules on different routes never share
a counter by accident, and the name is the same in every process and after a
restart (durable counters keep their meaning).
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from .._paths import compile_path, normalize_method, path_matches
from .._types import Scope
from ..errors import ConfigurationError
from ..store.base import ALGORITHMS, Algorithm

if TYPE_CHECKING:
    from ._costs import CostRequest

__all__ = [
    "CLIENT",
    "GLOBAL",
    "RATE_GRAMMAR",
    "Concurrency",
    "CostFunc",
    "LevelKey",
    "Limit",
    "PlanFunc",
    "Plans",
    "Rule",
]

_T = TypeVar("_T")

# Names travel in a structured-field string (RateLimit-Policy) and in store keys.
_NAME = re.compile(r"[A-Za-z0-9_.:/+{}-]{1,64}\Z")
_NAME_RULE = "1-64 characters of A-Z a-z 0-9 _ . : / + - { }"
# Level names travel in limit names and problem bodies.
_LEVEL = re.compile(r"[A-Za-z0-9_-]{1,32}\Z")
_LEVEL_RULE = "1-32 characters of A-Z a-z 0-9 _ -"
CLIENT = "client"
"""The level of a rule's own key (the middleware's ``key=``): every limit's by default."""
GLOBAL = "global"
"""The level of everyone together: one counter, whoever the client."""

_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
}
# One rate: "<amount>/[<count>]<unit> [<algorithm> [burst <n>]]", "/" or " per ":
# "5/minute", "5 per minute", "10/5s", "10 per 5 minutes sliding", "5/second gcra burst 20".
_RATE = re.compile(
    r"\s*(\d+)\s*(?:/|\s+per\s+)\s*(\d+(?:\.\d+)?)?\s*([A-Za-z]+)"
    r"(?:\s+([A-Za-z]+)(?:\s+burst\s+(\d+))?)?\s*\Z",
    re.I,
)
RATE_GRAMMAR = (
    "'<amount>/[<count>]<unit> [fixed | sliding | gcra [burst <n>]]' ('per' for '/'),"
    " e.g. '5/minute', '10 per 5 seconds sliding', '5/second gcra burst 20'"
)


def _default_name(
    amount: int | None, window: float, algorithm: Algorithm, burst: int, level: str
) -> str:
    """A limit's name when none is given: its rate and, but for fixed windows, its algorithm
    (a fixed window's is as it always was, so its counters keep their meaning), after its
    level unless that is the client's. ``amount`` None: the name a limit takes in a rule
    with plans, the same whatever the amount, so a plan change keeps the count."""
    name = f"per-{window:g}s" if amount is None else f"{amount}-per-{window:g}s"
    if algorithm == "gcra":
        name += "-gcra" if amount is None or burst == amount else f"-gcra-burst-{burst}"
    elif algorithm != "fixed":
        name += f"-{algorithm}"
    return name if level == CLIENT else f"{level}:{name}"


@dataclass(frozen=True, slots=True, init=False)
class Limit:
    """``amount`` requests per ``window`` of seconds, counted by ``algorithm``.

    ``"fixed"`` (the default): windows starting at the key's first hit.
    ``"sliding"``: the previous window's count weighted by its remaining overlap.
    ``"gcra"``: a bucket of ``burst`` requests (default ``amount``) refilled at
    ``amount`` per ``window``. docs/design.md ("Policies") states each exactly.
    ``Limit("5/minute")`` reads a rate string (:data:`RATE_GRAMMAR`: ``"5 per
    minute"``, ``"10/5s sliding"``, ``"5/second gcra burst 20"``); :meth:`parse`
    reads several (``"100/day; 10/second"``). ``name`` defaults to the rate
    (``"5-per-60s"``; ``"10-per-5s-sliding"``, ``"5-per-1s-gcra-burst-20"``).

    ``level`` says whose counter it is: ``"client"`` (the default: the rule's key,
    the middleware's ``key=``), ``"global"`` (everyone together, one counter), or
    a level the rule declares with its own key function (``Rule(levels={"org":
    org_of})``); a limit of another level is named after it (``"global:5-per-60s"``).

    ``slice`` (fixed windows only): a hot limit every request shares (a global or
    per-tenant cap) is decided on each host from slices of ``slice`` units it
    leases from the store, one round trip per slice instead of one per batch. It
    never admits more than ``amount`` per window; it may admit fewer, by at most
    the units hosts hold unspent when the window ends (under ``slice`` each), and
    a host that stops returns what it holds. docs/design.md, "Slices".
    """

    amount: int
    window: float
    name: str
    algorithm: Algorithm
    burst: int
    """gcra's bucket size; the amount for the other algorithms."""
    level: str
    """Whose counter: ``"client"``, ``"global"``, or a level its rule declares."""
    slice: int | None
    """Units a host leases at a time (None: every hit is decided by the store)."""

    def __init__(
        self,
        amount: int | str,
        window: float | None = None,
        name: str = "",
        *,
        algorithm: Algorithm | None = None,
        burst: int | None = None,
        level: str = CLIENT,
        slice: int | None = None,
    ) -> None:
        if isinstance(amount, str):
            if window is not None:
                raise ConfigurationError(
                    f"a rate string carries its own window; got Limit({amount!r}, {window!r})"
                )
            pieces = _pieces(amount)
            if len(pieces) != 1:
                raise ConfigurationError(
                    f"Limit() takes one rate, got {amount!r}; use Limit.parse() for several"
                )
            amount, window, said, bursting = _parse_rate(pieces[0])
            algorithm = _once("algorithm", said, algorithm)
            burst = _once("burst", bursting, burst)
        if isinstance(amount, bool) or not isinstance(amount, int) or amount < 1:
            raise ConfigurationError(f"limit amount must be an integer >= 1, got {amount!r}")
        if (
            isinstance(window, bool)
            or not (isinstance(window, int | float) and math.isfinite(window))
            or window <= 0
        ):
            raise ConfigurationError(f"limit window must be > 0 seconds, got {window!r}")
        if algorithm is None:
            algorithm = "fixed"
        elif algorithm not in ALGORITHMS:
            raise ConfigurationError(
                f"limit algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
            )
        if burst is None:
            burst = amount
        elif algorithm != "gcra":
            raise ConfigurationError(f"a burst applies to gcra limits only, got {algorithm!r}")
        elif isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigurationError(f"limit burst must be an integer >= 1, got {burst!r}")
        if not isinstance(level, str) or not _LEVEL.match(level):
            raise ConfigurationError(f"limit level must be {_LEVEL_RULE}, got {level!r}")
        if slice is not None:
            if isinstance(slice, bool) or not isinstance(slice, int) or not 1 <= slice <= amount:
                raise ConfigurationError(
                    f"a limit's slice must be an integer from 1 to its amount ({amount}),"
                    f" got {slice!r}"
                )
            if algorithm != "fixed":
                # A slice is units of one window, charged when leased: a sliding window
                # or a bucket has no window whose units a host could hold.
                raise ConfigurationError(
                    f"a slice applies to fixed-window limits only, got {algorithm!r}"
                )
        if not name:
            name = _default_name(amount, window, algorithm, burst, level)
        elif not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"limit name must be {_NAME_RULE}, got {name!r}")
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "burst", burst)
        object.__setattr__(self, "level", level)
        object.__setattr__(self, "slice", slice)

    def _named_for_plans(self) -> Limit:
        """This limit as a rule with plans counts it: a default name loses its amount, so
        every plan's limit of one window, algorithm and level shares one counter."""
        if self.name != _default_name(
            self.amount, self.window, self.algorithm, self.burst, self.level
        ):
            return self  # named by its author: kept
        name = _default_name(None, self.window, self.algorithm, self.burst, self.level)
        return Limit(
            self.amount,
            self.window,
            name,
            algorithm=self.algorithm,
            burst=self.burst if self.algorithm == "gcra" else None,
            level=self.level,
            slice=self.slice,
        )

    @staticmethod
    def parse(text: str) -> tuple[Limit, ...]:
        """The limits of a rate string: rates (:data:`RATE_GRAMMAR`) separated by ``;`` or
        ``,``."""
        return tuple(
            Limit(amount, window, algorithm=algorithm, burst=burst)
            for amount, window, algorithm, burst in map(_parse_rate, _pieces(text))
        )


def _pieces(text: str) -> list[str]:
    """The rates of a rate string, each stripped."""
    if not isinstance(text, str):
        raise ConfigurationError(f"a rate string must be a str, got {text!r}")
    pieces = [p.strip() for p in re.split(r"[;,]", text) if p.strip()]
    if not pieces:
        raise ConfigurationError(f"a rate string needs at least one rate, got {text!r}")
    return pieces


def _parse_rate(piece: str) -> tuple[int, float, Algorithm | None, int | None]:
    """One rate's amount, window, and the algorithm and burst it names (None: not named)."""
    match = _RATE.match(piece)
    if match is None:
        raise ConfigurationError(f"invalid rate {piece!r}: expected {RATE_GRAMMAR}")
    amount, count, unit, named, burst = match.groups()
    seconds = _UNITS.get(unit.lower())
    if seconds is None:
        raise ConfigurationError(
            f"invalid rate {piece!r}: unknown unit {unit!r} (use second, minute, hour or day);"
            f" expected {RATE_GRAMMAR}"
        )
    algorithm: Algorithm | None = None
    if named is not None:
        for known in ALGORITHMS:
            if named.lower() == known:
                algorithm = known
        if algorithm is None:
            raise ConfigurationError(
                f"invalid rate {piece!r}: unknown algorithm {named!r}; expected {RATE_GRAMMAR}"
            )
        if burst is not None and algorithm != "gcra":
            raise ConfigurationError(
                f"invalid rate {piece!r}: a burst applies to gcra only; expected {RATE_GRAMMAR}"
            )
    window = seconds * (1.0 if count is None else float(count))
    return (
        int(amount),
        int(window) if window.is_integer() else window,
        algorithm,
        None if burst is None else int(burst),
    )


def _once(what: str, said: _T | None, given: _T | None) -> _T | None:
    """A setting a rate string and a keyword may both give: the one given, or both alike."""
    if said is None or given is None or said == given:
        return given if said is None else said
    raise ConfigurationError(
        f"the rate string says {what} {said!r} and the keyword {what}={given!r}; give it once"
    )


@dataclass(frozen=True, slots=True, init=False)
class Concurrency:
    """At most ``amount`` requests of one key in flight at once: a cap, not a rate.

    Among a rule's limits (``Rule([Limit("100/minute"), Concurrency(2)])``), a
    request passes only if every rate limit has room *and* a slot of every
    concurrency limit is free, all or nothing: a request a rate limit refuses
    takes no slot, and one refused for want of a slot consumes no rate. It holds
    its slot until its response ends (before the last body chunk leaves), its
    handler raises or its client disconnects. A refusal is a 429 with
    ``Retry-After: 1`` (when a slot frees is unknown). The count is the store's,
    shared by every process and host on it; a process that dies holding slots
    frees them at once (SQLite) or within the store's lease (PostgreSQL, Redis).
    ``name`` defaults to ``"<amount>-in-flight"``.
    """

    amount: int
    name: str

    def __init__(self, amount: int, name: str = "") -> None:
        if isinstance(amount, bool) or not isinstance(amount, int) or amount < 1:
            raise ConfigurationError(f"concurrency amount must be an integer >= 1, got {amount!r}")
        if not name:
            name = f"{amount}-in-flight"
        elif not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"concurrency name must be {_NAME_RULE}, got {name!r}")
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "name", name)


Limits = Iterable[Limit | Concurrency | str] | Limit | Concurrency | str
"""What a rule counts: rate limits (a :class:`Limit`, or a rate string) and concurrency caps."""


def _limits_of(limits: Limits) -> tuple[tuple[Limit, ...], tuple[Concurrency, ...]]:
    if isinstance(limits, str):
        return Limit.parse(limits), ()
    if isinstance(limits, Limit):
        return (limits,), ()
    if isinstance(limits, Concurrency):
        return (), (limits,)
    limits = tuple(limits)
    if not all(isinstance(limit, Limit | Concurrency | str) for limit in limits):
        raise ConfigurationError(
            "rule limits must be Limit or Concurrency instances or rate strings"
        )
    rates: list[Limit] = []
    caps: list[Concurrency] = []
    for limit in limits:
        if isinstance(limit, Concurrency):
            caps.append(limit)
        else:
            rates.extend(Limit.parse(limit) if isinstance(limit, str) else [limit])
    return tuple(rates), tuple(caps)


def _unique_names(
    limits: tuple[Limit, ...], caps: tuple[Concurrency, ...] = (), where: str = ""
) -> None:
    names = [limit.name for limit in limits] + [cap.name for cap in caps]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"limit names within a rule{where} must be unique, got {names}")


#: A level's key (see :class:`Rule`): given the request's ASGI scope, the key its limits count
#: under, or None when the level does not apply to the request (its limits are left out);
#: sync, or async. It may read what the app's authentication left in the scope.
LevelKey = Callable[[Scope], str | Awaitable[str | None] | None]
#: A request's plan (see :class:`Plans`): given the ASGI scope, the name of a plan, or None
#: for the rule's own limits; sync, or async (a lookup in a database).
PlanFunc = Callable[[Scope], str | Awaitable[str | None] | None]
#: A request's cost (see :class:`Rule`): given a :class:`~porch.ratelimit.CostRequest` (the
#: scope, and the body on demand), an int >= 0; sync, or async.
CostFunc = Callable[["CostRequest"], int | Awaitable[int]]


@dataclass(frozen=True, slots=True, init=False)
class Plans:
    """Limits chosen per request: ``plan`` names the request's plan, one of ``plans``.

    ``plans`` maps each plan's name to its limits (rate strings or Limits, as a
    rule takes them). ``plan(scope)`` (sync or async: an API key looked up in a
    database) returns a plan's name, or None for the rule's own limits; a name
    that is no plan is logged and gets the rule's own limits too. A client's plan
    is looked up once and kept for ``cache`` seconds per client key (at most
    ``entries`` keys, the oldest forgotten first), so a plan change takes effect
    within ``cache`` seconds. The count carries over: in a rule with plans, a
    limit's default name leaves its amount out (``"per-60s"``), so every plan's
    limit of one window, algorithm and level counts on one counter and an upgrade
    from 5 to 50 a minute keeps the 5 already used (name a limit to keep it apart).
    """

    plans: tuple[tuple[str, tuple[Limit, ...]], ...]
    plan: PlanFunc
    cache: float
    entries: int

    def __init__(
        self,
        plans: Mapping[str, Limits],
        *,
        plan: PlanFunc,
        cache: float = 60.0,
        entries: int = 10_000,
    ) -> None:
        if not isinstance(plans, Mapping) or not plans:
            raise ConfigurationError(f"plans must map plan names to limits, got {plans!r}")
        parsed: list[tuple[str, tuple[Limit, ...]]] = []
        for name, limits in plans.items():
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"a plan's name must be a non-empty str, got {name!r}")
            rates, caps = _limits_of(limits)
            if caps:
                raise ConfigurationError(
                    f"plan {name!r}: a plan holds rate limits; a Concurrency cap goes on the"
                    " rule, for every plan"
                )
            found = tuple(limit._named_for_plans() for limit in rates)
            for limit in found:
                if limit.slice is not None:
                    raise ConfigurationError(
                        f"plan {name!r}: limit {limit.name!r} has a slice; a sliced limit goes"
                        " on the rule, shared by every plan"
                    )
            if not found:
                raise ConfigurationError(f"plan {name!r} needs at least one Limit")
            _unique_names(found, where=f" (plan {name!r})")
            parsed.append((name, found))
        if not callable(plan):
            raise ConfigurationError(f"plan must be a callable(scope) -> str | None, got {plan!r}")
        if (
            isinstance(cache, bool)
            or not isinstance(cache, int | float)
            or not 0 <= cache < math.inf
        ):
            raise ConfigurationError(f"plans' cache must be >= 0 seconds, got {cache!r}")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
            raise ConfigurationError(f"plans' entries must be an integer >= 1, got {entries!r}")
        object.__setattr__(self, "plans", tuple(parsed))
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "cache", float(cache))
        object.__setattr__(self, "entries", entries)

    def limits(self, name: str) -> tuple[Limit, ...] | None:
        """The limits of plan ``name`` (None: no such plan)."""
        for plan, limits in self.plans:
            if plan == name:
                return limits
        return None


@dataclass(frozen=True, slots=True, init=False)
class Rule:
    """Which requests a set of limits applies to: a path (prefix or template) and methods.

    All limits of a rule are checked together: a request passes only if every
    limit has room (and, for :class:`Concurrency` caps, a free slot), and a
    refused request consumes none of them. ``limits`` holds the rate limits,
    ``concurrency`` the caps, in the order given. ``path`` is
    a prefix (``/api`` selects ``/api`` and ``/api/x``, never ``/apiary``) and
    may hold ``{param}`` templates, one segment each (``/users/{id}/follow``).
    ``name`` is the counters' namespace (default: derived from path and
    methods; ``"default"`` for the whole app). Rules with one name count
    together only when they say so with ``shared=True`` (and have the same
    limits); otherwise a second rule under a taken name is a ConfigurationError
    when its limiter is built. ``websocket=True`` also limits WebSocket
    handshakes (refused before accept).

    ``cost``: what a request consumes of every limit, an int >= 0 (default 1)
    or a function of the request (:data:`CostFunc`, sync or async; given a
    :class:`~porch.ratelimit.CostRequest`, it may read the body; a ValueError,
    LookupError or TypeError it raises means the request is not what it expects,
    answered 400, and a body over its cap 413). ``settle=True``: the cost is a
    reservation, and the handler reports what the request actually cost with
    :func:`porch.ratelimit.settle`; the difference is refunded or charged before
    the response's last body chunk leaves (docs/design.md, "Policies": the settle
    rule). A handler that raises, or whose client leaves, before it reported keeps
    the estimate.

    ``levels``: more keys to count under, by name (``{"org": org_of}``: a
    :data:`LevelKey`), for the limits whose ``level`` names them; ``"client"``
    (the middleware's key) and ``"global"`` (everyone) need no declaring. Every
    limit of every level is one decision, all or nothing; a refusal names the
    level that refused. ``plans``: limits chosen per request (:class:`Plans`);
    ``limits`` are then those of a request without a plan.
    """

    limits: tuple[Limit, ...]
    concurrency: tuple[Concurrency, ...]
    path: str
    methods: frozenset[str] | None
    name: str
    shared: bool
    websocket: bool
    pattern: re.Pattern[str] | None
    cost: int | CostFunc
    settle: bool
    levels: tuple[tuple[str, LevelKey], ...]
    plans: Plans | None

    def __init__(
        self,
        limits: Limits,
        *,
        path: str = "/",
        methods: Iterable[str] | None = None,
        name: str | None = None,
        shared: bool = False,
        websocket: bool = False,
        cost: int | CostFunc = 1,
        settle: bool = False,
        levels: Mapping[str, LevelKey] | None = None,
        plans: Plans | None = None,
    ) -> None:
        rates, concurrency = _limits_of(limits)
        if not rates and not concurrency:
            raise ConfigurationError("a rule needs at least one Limit (or Concurrency)")
        if plans is not None:
            if not isinstance(plans, Plans):
                raise ConfigurationError(f"plans must be a Plans, got {plans!r}")
            rates = tuple(limit._named_for_plans() for limit in rates)
        _unique_names(rates, concurrency)
        if not isinstance(path, str) or not path.startswith("/"):
            raise ConfigurationError(f"rule path must start with '/', got {path!r}")
        path = path.rstrip("/") or "/"
        pattern = compile_path(path)
        normalized = None if methods is None else frozenset(normalize_method(m) for m in methods)
        if normalized is not None and not normalized:
            raise ConfigurationError("rule methods must name at least one method, or be None")
        if name is None:
            name = _derived_name(path, normalized)
        elif not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"rule name must be {_NAME_RULE}, got {name!r}")
        if not callable(cost) and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 0):
            raise ConfigurationError(
                f"a rule's cost must be an integer >= 0 or a function of the request, got {cost!r}"
            )
        declared = _levels_of(levels)
        known = {CLIENT, GLOBAL, *(level for level, _ in declared)}
        every = rates + tuple(
            limit for _, found in (plans.plans if plans else ()) for limit in found
        )
        sliced = [limit.name for limit in rates if limit.slice is not None]
        if sliced and (settle or plans is not None or concurrency):
            # A host decides a sliced limit alone; a settle, a plan's other amount or a
            # slot taken with the hit needs the store to decide every limit together.
            other = (
                "settle=True" if settle else "plans" if plans is not None else "a Concurrency cap"
            )
            raise ConfigurationError(
                f"limit {sliced[0]!r} has a slice, which a rule with {other} cannot take"
                " (without its slice, the store decides it with the rest)"
            )
        for limit in every:
            if limit.level not in known:
                raise ConfigurationError(
                    f"limit {limit.name!r} counts under level {limit.level!r}, which the rule"
                    f" does not declare; give its key: levels={{{limit.level!r}: key}}"
                )
        object.__setattr__(self, "limits", rates)
        object.__setattr__(self, "concurrency", concurrency)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "methods", normalized)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shared", bool(shared))
        object.__setattr__(self, "websocket", bool(websocket))
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "settle", bool(settle))
        object.__setattr__(self, "levels", declared)
        object.__setattr__(self, "plans", plans)

    def matches(self, method: str, path: str) -> bool:
        """Whether a request is selected: ``path`` equals the prefix or lies below it.

        ``method`` must already be normalized (:func:`normalize_method`).
        """
        if self.methods is not None and method not in self.methods:
            return False
        if self.pattern is not None:
            return self.pattern.match(path) is not None
        return path_matches(self.path, path)

    def describe(self) -> str:
        """Who claimed a namespace, for configuration errors."""
        return f"the rule for {self.path!r}"

    def every_limit(self) -> tuple[Limit, ...]:
        """The rule's own limits and every plan's."""
        plans = self.plans.plans if self.plans is not None else ()
        return self.limits + tuple(limit for _, found in plans for limit in found)

    def signature(self) -> tuple[object, ...]:
        """What a namespace means: two rules with one name must agree on it (see Namespaces)."""
        limits: tuple[object, ...] = tuple(map(_meaning, self.limits))
        if self.concurrency:
            limits += tuple((cap.name, cap.amount, "in-flight") for cap in self.concurrency)
        if self.plans is not None:
            plans = tuple((plan, tuple(map(_meaning, found))) for plan, found in self.plans.plans)
            limits = (*limits, ("plans", plans))
        if self.shared:
            return ("shared", limits)
        methods = None if self.methods is None else tuple(sorted(self.methods))
        return ("rule", self.path, methods, limits)


def _meaning(limit: Limit) -> tuple[object, ...]:
    """What a limit counts, as a namespace's signature compares it."""
    meaning: tuple[object, ...] = (limit.name, limit.amount, float(limit.window))
    if limit.algorithm != "fixed":
        meaning += (limit.algorithm, limit.burst)
    if limit.level != CLIENT:
        meaning += (limit.level,)
    return meaning


def _levels_of(levels: Mapping[str, LevelKey] | None) -> tuple[tuple[str, LevelKey], ...]:
    if levels is None:
        return ()
    if not isinstance(levels, Mapping):
        raise ConfigurationError(f"levels must map level names to key functions, got {levels!r}")
    for level, key in levels.items():
        if level in (CLIENT, GLOBAL):
            raise ConfigurationError(
                f"level {level!r} is porch's own: 'client' counts under the middleware's key,"
                " 'global' under one key for everyone"
            )
        if not isinstance(level, str) or not _LEVEL.match(level):
            raise ConfigurationError(f"a level's name must be {_LEVEL_RULE}, got {level!r}")
        if not callable(key):
            raise ConfigurationError(
                f"level {level!r} needs a key function callable(scope) -> str | None, got {key!r}"
            )
    return tuple(levels.items())


def _derived_name(path: str, methods: frozenset[str] | None) -> str:
    """The namespace of a rule without a name: stable across processes and restarts."""
    if methods is None:
        return "default" if path == "/" else path
    return "+".join(sorted(methods)) + ":" + path
