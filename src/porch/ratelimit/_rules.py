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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from .._paths import compile_path, normalize_method, path_matches
from ..errors import ConfigurationError
from ..store.base import ALGORITHMS, Algorithm

__all__ = ["RATE_GRAMMAR", "Concurrency", "Limit", "Rule"]

_T = TypeVar("_T")

# Names travel in a structured-field string (RateLimit-Policy) and in store keys.
_NAME = re.compile(r"[A-Za-z0-9_.:/+{}-]{1,64}\Z")
_NAME_RULE = "1-64 characters of A-Z a-z 0-9 _ . : / + - { }"

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


def _default_name(amount: int, window: float, algorithm: Algorithm, burst: int) -> str:
    """A limit's name when none is given: its rate and, but for fixed windows, its algorithm
    (a fixed window's is as it always was, so its counters keep their meaning)."""
    name = f"{amount}-per-{window:g}s"
    if algorithm == "gcra":
        return name + ("-gcra" if burst == amount else f"-gcra-burst-{burst}")
    return name if algorithm == "fixed" else f"{name}-{algorithm}"


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
    """

    amount: int
    window: float
    name: str
    algorithm: Algorithm
    burst: int
    """gcra's bucket size; the amount for the other algorithms."""

    def __init__(
        self,
        amount: int | str,
        window: float | None = None,
        name: str = "",
        *,
        algorithm: Algorithm | None = None,
        burst: int | None = None,
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
        if not name:
            name = _default_name(amount, window, algorithm, burst)
        elif not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(f"limit name must be {_NAME_RULE}, got {name!r}")
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "burst", burst)

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
    rates: list[Limit] = []
    caps: list[Concurrency] = []
    for limit in limits:
        if isinstance(limit, Concurrency):
            caps.append(limit)
        else:
            rates.extend(Limit.parse(limit) if isinstance(limit, str) else [limit])
    return tuple(rates), tuple(caps)


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
    """

    limits: tuple[Limit, ...]
    concurrency: tuple[Concurrency, ...]
    path: str
    methods: frozenset[str] | None
    name: str
    shared: bool
    websocket: bool
    pattern: re.Pattern[str] | None

    def __init__(
        self,
        limits: Limits,
        *,
        path: str = "/",
        methods: Iterable[str] | None = None,
        name: str | None = None,
        shared: bool = False,
        websocket: bool = False,
    ) -> None:
        if not isinstance(limits, str | Limit | Concurrency):
            limits = tuple(limits)
            if not all(isinstance(limit, Limit | Concurrency | str) for limit in limits):
                raise ConfigurationError(
                    "rule limits must be Limit or Concurrency instances or rate strings"
                )
        rates, concurrency = _limits_of(limits)
        if not rates and not concurrency:
            raise ConfigurationError("a rule needs at least one Limit (or Concurrency)")
        names = [limit.name for limit in rates] + [cap.name for cap in concurrency]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"limit names within a rule must be unique, got {names}")
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
        object.__setattr__(self, "limits", rates)
        object.__setattr__(self, "concurrency", concurrency)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "methods", normalized)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shared", bool(shared))
        object.__setattr__(self, "websocket", bool(websocket))
        object.__setattr__(self, "pattern", pattern)

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

    def signature(self) -> tuple[object, ...]:
        """What a namespace means: two rules with one name must agree on it (see Namespaces)."""
        limits: tuple[tuple[object, ...], ...] = tuple(
            (limit.name, limit.amount, float(limit.window))
            if limit.algorithm == "fixed"
            else (limit.name, limit.amount, float(limit.window), limit.algorithm, limit.burst)
            for limit in self.limits
        )
        if self.concurrency:
            limits += tuple((cap.name, cap.amount, "in-flight") for cap in self.concurrency)
        if self.shared:
            return ("shared", limits)
        methods = None if self.methods is None else tuple(sorted(self.methods))
        return ("rule", self.path, methods, limits)


def _derived_name(path: str, methods: frozenset[str] | None) -> str:
    """The namespace of a rule without a name: stable across processes and restarts."""
    if methods is None:
        return "default" if path == "/" else path
    return "+".join(sorted(methods)) + ":" + path
