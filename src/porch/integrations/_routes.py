"""Limits and idempotency declared on a route, and the guard wrapped around that route's app.

Framework-free: :mod:`porch.integrations.starlette` finds the declarations (decorators on
endpoints, FastAPI dependencies) and wraps each route's ASGI app with a guard
built here from the very middlewares the app level uses, over the app's one
pool, so a route answers exactly as the middlewares do (same headers, same
bodies, same all-or-nothing counting). Only requests the router hands to the
route are counted: a 404, a 405 or a trailing-slash redirect never is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from .._eventlog import EventLog
from .._paths import normalize_method
from .._types import ASGIApp, Receive, Scope, Send
from ..errors import ConfigurationError, RateLimitExceeded
from ..idempotency._keys import ScopeFunc
from ..idempotency._middleware import DEFAULT_QUOTA, IdempotencyMiddleware, IdempotencyRule
from ..identity import KeyFunc
from ..pool._pool import KeyPool
from ..ratelimit._decisions import HeaderStyle
from ..ratelimit._middleware import RateLimitMiddleware, Refusal, RefusalFactory, default_refusal
from ..ratelimit._rules import Limit, Rule
from ..store.base import Quota

_logger = logging.getLogger("porch.routes")

__all__ = ["GUARDS", "RouteIdempotency", "RouteLimit", "guard"]

# The ids of the declarations whose guard the running request passed through. The endpoint
# and dependency checks read it (a context variable: an endpoint need not take the request,
# and a sync one runs in a thread that copies the context).
GUARDS: ContextVar[frozenset[int]] = ContextVar("porch_guards", default=frozenset())
_UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class RouteLimit:
    """A rate limit declared on a route: rates (``"5/minute"``, ``"100/day; 10/second"``, or
    Limits), the client ``key`` (default: the installer's, else the peer host), and the counters'
    ``name`` (default: derived from the route's methods and path template)."""

    __slots__ = ("dry_run", "fail_open", "key", "limits", "log", "name", "shared")

    def __init__(
        self,
        rate: str | Limit | Iterable[Limit | str],
        *,
        key: KeyFunc | None = None,
        name: str | None = None,
        shared: bool = False,
        dry_run: bool = False,
        fail_open: bool = False,
    ) -> None:
        # Validated now, where it is declared (the rule is rebuilt for its route on install).
        rule = Rule(rate, name=name, shared=shared)
        if shared and name is None:
            raise ConfigurationError("a shared route limit needs a name= to share")
        if key is not None and not callable(key):
            raise ConfigurationError(f"key must be a callable(scope) -> str, got {key!r}")
        self.limits = rule.limits
        self.key = key
        self.name = name
        self.shared = bool(shared)
        self.dry_run = bool(dry_run)
        self.fail_open = bool(fail_open)
        # "Never installed" is logged through it, throttled (once a minute per path).
        self.log = EventLog(_logger)


class RouteIdempotency:
    """``Idempotency-Key`` honoured on a route (for its unsafe methods, or ``methods``);
    the settings are :class:`~porch.IdempotencyMiddleware`'s."""

    __slots__ = ("log", "methods", "required", "rule", "settings")

    # Whether the declaration puts the Idempotency-Key header in the schema itself (a
    # FastAPI dependency's Header parameter does); else install() documents it.
    documents_header = False

    def __init__(
        self,
        *,
        required: bool = False,
        methods: Iterable[str] | None = None,
        digest_headers: Iterable[str] = (),
        scope: ScopeFunc | None = None,
        ttl: float = 86400.0,
        wait_timeout: float = 30.0,
        max_body: int = 1 << 20,
        max_stored: int = 1 << 20,
        quota: Quota = DEFAULT_QUOTA,
    ) -> None:
        self.methods = None if methods is None else frozenset(normalize_method(m) for m in methods)
        self.required = bool(required)
        # Validated now: the rule's header names (the rest when installed, with the pool).
        self.rule = IdempotencyRule(
            methods=self.methods or _UNSAFE, required=required, digest_headers=digest_headers
        )
        self.settings: dict[str, Any] = {
            "scope": scope,
            "ttl": ttl,
            "wait_timeout": wait_timeout,
            "max_body": max_body,
            "max_stored": max_stored,
            "quota": quota,
        }
        self.log = EventLog(_logger)


def raising_refusal(exception: type[RateLimitExceeded]) -> RefusalFactory:
    """Refusals raised as ``exception`` when the app has a handler for it (or for status 429),
    so the app's own handlers shape the 429; otherwise answered as the middleware answers."""

    def factory(scope: Scope, refusal: Refusal) -> ASGIApp:
        if scope["type"] == "http" and _handled(scope, exception):
            return _Raise(exception(refusal))
        return default_refusal(scope, refusal)

    return factory


def _handled(scope: Scope, exception: type[RateLimitExceeded]) -> bool:
    handlers = scope.get("starlette.exception_handlers")
    if not handlers:
        return False
    by_class, by_status = handlers
    if 429 in by_status:
        return True
    # Only porch's classes: a catch-all HTTPException handler keeps porch's problem body.
    return any(cls in by_class for cls in exception.__mro__ if issubclass(cls, RateLimitExceeded))


class _Raise:
    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise self.exc


class _RouteRule(Rule):
    """A rule that always applies (the router already chose the route), named for its route."""

    __slots__ = ("route",)

    route: str

    def __init__(
        self, limits: tuple[Limit, ...], *, route: str, derived: str | None, **kwargs: Any
    ) -> None:
        super().__init__(limits, **kwargs)
        object.__setattr__(self, "route", route)
        if derived is not None:
            # Derived from the route, not chosen: any path may be in it, however long.
            object.__setattr__(self, "name", derived)

    def signature(self) -> tuple[object, ...]:
        if self.shared:
            return super().signature()
        return ("route", self.route, super().signature()[-1])

    def describe(self) -> str:
        return f"the route limit on {self.route}"


class _Mark:
    """Records which declarations guard this request (GUARDS: the endpoint checks it)."""

    __slots__ = ("app", "ids")

    def __init__(self, app: ASGIApp, ids: frozenset[int]) -> None:
        self.app = app
        self.ids = ids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = GUARDS.set(GUARDS.get() | self.ids)
        try:
            await self.app(scope, receive, send)
        finally:
            GUARDS.reset(token)


def guard(
    app: ASGIApp,
    *,
    pool: KeyPool,
    path: str,
    methods: Iterable[str] | None,
    websocket: bool,
    limits: list[RouteLimit],
    idempotency: list[RouteIdempotency],
    key: KeyFunc | None,
    on_refused: RefusalFactory,
    headers: HeaderStyle = "both",
) -> ASGIApp:
    """``app`` (a route's) wrapped: rate limits outside (a refused request never claims a key),
    idempotency inside. Every namespace is claimed on ``pool`` now."""
    normalized = None if methods is None else sorted({normalize_method(m) for m in methods})
    route = ("WS" if websocket else "+".join(normalized or ["*"])) + ":" + path
    inner = app
    if len(idempotency) > 1:
        raise ConfigurationError(f"route {route} declares idempotency more than once")
    if idempotency:
        declared = idempotency[0]
        if websocket:
            raise ConfigurationError(f"idempotency cannot be declared on a WebSocket route {path}")
        honoured = declared.methods or (_UNSAFE & set(normalized or _UNSAFE))
        if not honoured:
            raise ConfigurationError(
                f"idempotency on route {route} has no unsafe method to honour; pass methods="
            )
        inner = IdempotencyMiddleware(
            inner,
            pool=pool,
            rules=IdempotencyRule(
                methods=honoured,
                required=declared.required,
                digest_headers=[n.decode("latin-1") for n in declared.rule.digest_headers],
            ),
            **declared.settings,
        )
    # Limits declared with the same key and options are one rule: checked all-or-nothing.
    groups: dict[tuple[object, ...], list[RouteLimit]] = {}
    for declared_limit in limits:
        group = (
            id(declared_limit.key),
            declared_limit.name,
            declared_limit.shared,
            declared_limit.dry_run,
            declared_limit.fail_open,
        )
        groups.setdefault(group, []).append(declared_limit)
    for i, members in enumerate(reversed(list(groups.values()))):
        first = members[0]
        derived = None
        if first.name is None:
            derived = f"route:{route}" + (f"#{len(groups) - i}" if len(groups) > 1 else "")
        rule = _RouteRule(
            # The same limit declared twice (on a router and on its route) is counted once.
            tuple(dict.fromkeys(limit for member in members for limit in member.limits)),
            route=route,
            derived=derived,
            name=first.name,
            shared=first.shared,
            websocket=websocket,
        )
        inner = RateLimitMiddleware(
            inner,
            pool=pool,
            rules=rule,
            key=first.key if first.key is not None else key,
            exempt=(),
            dry_run=first.dry_run,
            fail_open=first.fail_open,
            on_refused=on_refused,
            headers=headers,
        )
    return _Mark(inner, frozenset(id(d) for d in [*limits, *idempotency]))
