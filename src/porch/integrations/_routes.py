"""Limits and idempotency declared on a route, and the guard wrapped around that route's app.

Framework-free: :mod:`porch.integrations.starlette` finds the declarations (decorators on
endpoints, FastAPI dependencies) and wraps each route's ASGI app with a guard
built here from the very middlewares the app level uses, over the app's one
pool, so a route answers exactly as the middlewares do (same headers, same
bodies, same all-or-nothing counting). Only requests the router hands to the
route are counted: a 404, a 405 or a trailing-slash redirect never is.

A limit whose key is only known inside the route (a FastAPI dependency's result: the
user the app's auth resolved) is *deferred*: the guard builds its middleware as for any
other and hands it to the declaration, which runs it when it has the key (see
:class:`Handoff`). The middleware then runs in a task of its own, suspended where it
would call the app until the route has answered, so its headers, its settle and its
caps' slots are exactly the middleware's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .._eventlog import EventLog
from .._paths import normalize_method
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..errors import ConfigurationError, RateLimitExceeded
from ..idempotency._keys import ScopeFunc
from ..idempotency._middleware import DEFAULT_QUOTA, IdempotencyMiddleware, IdempotencyRule
from ..idempotency._policy import IdempotencyPolicy
from ..identity import ClientIdentity, KeyFunc
from ..pool._pool import KeyPool
from ..ratelimit._decisions import HeaderStyle
from ..ratelimit._middleware import (
    Exemption,
    RateLimitMiddleware,
    Refusal,
    RefusalFactory,
    default_refusal,
)
from ..ratelimit._rules import CostFunc, LevelKey, Limit, Plans, Rule
from ..store.base import Quota

_logger = logging.getLogger("porch.routes")

__all__ = [
    "GUARDS",
    "HANDOFF",
    "Answered",
    "Declaration",
    "Declared",
    "Handoff",
    "RouteIdempotency",
    "RouteLimit",
    "guard",
]

# The ids of the declarations whose guard the running request passed through. The endpoint
# and dependency checks read it (a context variable: an endpoint need not take the request,
# and a sync one runs in a thread that copies the context).
GUARDS: ContextVar[frozenset[int]] = ContextVar("porch_guards", default=frozenset())
# The running request's deferred limits, when its route has any in force (see Handoff).
HANDOFF: ContextVar[Handoff | None] = ContextVar("porch_handoff", default=None)
_UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class RouteLimit:
    """A rate limit declared on a route: rates (``"5/minute"``, ``"10/minute sliding"``,
    ``"100/day; 10/second"``, or Limits), the client ``key`` (default: the installer's, else
    the peer host), the counters' ``name`` (default: derived from the route's methods and
    path template), ``exempt`` predicates (see :class:`~porch.RateLimitMiddleware`), and
    ``enabled`` (False: the route runs unlimited, as with the middleware's off switch; it
    may be set later). ``cost``, ``settle``, ``levels`` and ``plans`` are
    :class:`~porch.Rule`'s: what a request consumes (a function of the request too),
    whether the handler settles it (:func:`porch.ratelimit.settle`), the keys of
    levels other than the client's, and limits per plan."""

    __slots__ = (
        "cost",
        "dry_run",
        "enabled",
        "exempt",
        "fail_open",
        "key",
        "levels",
        "limits",
        "log",
        "name",
        "plans",
        "settle",
        "shared",
    )

    # Whether the key is only known inside the route, so the declaration runs its own
    # middleware (Handoff.hit) once it has it: a FastAPI dependency's result.
    deferred = False

    def __init__(
        self,
        rate: str | Limit | Iterable[Limit | str],
        *,
        key: KeyFunc | None = None,
        name: str | None = None,
        shared: bool = False,
        dry_run: bool = False,
        fail_open: bool = False,
        exempt: Exemption | Iterable[Exemption] = (),
        enabled: bool = True,
        cost: int | CostFunc = 1,
        settle: bool = False,
        levels: Mapping[str, LevelKey] | None = None,
        plans: Plans | None = None,
    ) -> None:
        # Validated now, where it is declared (the rule is rebuilt for its route on install).
        rule = Rule(
            rate, name=name, shared=shared, cost=cost, settle=settle, levels=levels, plans=plans
        )
        if shared and name is None:
            raise ConfigurationError("a shared route limit needs a name= to share")
        if key is not None and not callable(key):
            raise ConfigurationError(f"key must be a callable(scope) -> str, got {key!r}")
        predicates = (exempt,) if callable(exempt) else tuple(exempt)
        for predicate in predicates:
            if not callable(predicate):
                raise ConfigurationError(
                    f"a route limit's exempt= takes predicates (callables), got {predicate!r}"
                )
        self.limits = rule.limits
        self.cost = rule.cost
        self.settle = rule.settle
        self.levels = rule.levels
        self.plans = rule.plans
        self.key = key
        self.name = name
        self.shared = bool(shared)
        self.dry_run = bool(dry_run)
        self.fail_open = bool(fail_open)
        self.exempt: tuple[Exemption, ...] = predicates
        self.enabled = bool(enabled)
        # "Never installed" is logged through it, throttled (once a minute per path).
        self.log = EventLog(_logger)


class RouteIdempotency:
    """``Idempotency-Key`` honoured on a route (for its unsafe methods, or ``methods``),
    handled as ``policy`` says (an :class:`~porch.IdempotencyPolicy`; default: the
    default policy). ``required``, ``digest_headers``, ``ttl``, ``wait_timeout``,
    ``max_body`` and ``max_stored`` are kept from before policies: given, they change
    it. ``scope``, ``quota``, ``identity`` and ``integrity_key`` are
    :class:`~porch.IdempotencyMiddleware`'s.
    ``count_replays``: whether a replay (and a duplicate that waited for its owner, a
    409, a 422) counts against the route's rate limits — True: the limits are checked
    first, as every request; False: idempotency answers first and only a request that
    runs the handler is counted. ``enabled``: False turns it off (it may be set later)."""

    __slots__ = (
        "count_replays",
        "enabled",
        "identity",
        "integrity_key",
        "log",
        "methods",
        "policy",
        "quota",
        "required",
        "scope",
    )

    # Whether the declaration puts the Idempotency-Key header in the schema itself (a
    # FastAPI dependency's Header parameter does); else install() documents it.
    documents_header = False

    def __init__(
        self,
        *,
        policy: IdempotencyPolicy | None = None,
        required: bool | None = None,
        methods: Iterable[str] | None = None,
        digest_headers: Iterable[str] | None = None,
        scope: ScopeFunc | None = None,
        ttl: float | None = None,
        wait_timeout: float | None = None,
        max_body: int | None = None,
        max_stored: int | None = None,
        quota: Quota = DEFAULT_QUOTA,
        count_replays: bool = True,
        enabled: bool = True,
        identity: KeyFunc | None = None,
        integrity_key: bytes | Sequence[bytes] | None = None,
    ) -> None:
        self.methods = None if methods is None else frozenset(normalize_method(m) for m in methods)
        if policy is not None and not isinstance(policy, IdempotencyPolicy):
            raise ConfigurationError(f"policy must be an IdempotencyPolicy, got {policy!r}")
        changes = {
            name: value
            for name, value in (
                ("required", required),
                ("digest_headers", digest_headers),
                ("ttl", ttl),
                ("wait_timeout", wait_timeout),
                ("max_body", max_body),
                ("max_stored", max_stored),
            )
            if value is not None
        }
        self.count_replays = bool(count_replays)
        self.enabled = bool(enabled)
        # Validated now, where it is declared (the quota with the middleware, when installed).
        base = policy if policy is not None else IdempotencyPolicy()
        self.policy = base.replace(**changes) if changes else base
        self.required = self.policy.required
        self.scope = scope
        self.quota = quota
        self.identity = identity
        self.integrity_key = integrity_key
        self.log = EventLog(_logger)


Declaration = RouteLimit | RouteIdempotency


@dataclass(frozen=True, slots=True)
class Declared:
    """A declaration found on a route: ``via`` is None for a decorator on the endpoint, else
    every chain of dependency callables leading to it (the route's own dependencies first),
    so the app's ``dependency_overrides`` can be honoured as FastAPI honours them."""

    declaration: Declaration
    via: tuple[tuple[Callable[..., Any], ...], ...] | None = None


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


class Answered(Exception):
    """Raised by a deferred declaration whose middleware has answered the request itself (a
    429, a 503, a 400): the route stops there, and its guard swallows it."""


class _Step:
    """One deferred limit's run in one request: the resolved key, and where its middleware
    goes on (the send it hands the route) and waits for the route to finish."""

    __slots__ = ("done", "going", "key")

    def __init__(self, key: str | None, going: asyncio.Future[Send], done: asyncio.Event) -> None:
        self.key = key
        self.going = going
        self.done = done


# The step of the deferred middleware running in this task (set while its task is created,
# so the task's copy of the context holds it).
_STEP: ContextVar[_Step | None] = ContextVar("porch_step", default=None)


async def _go_on(scope: Scope, receive: Receive, send: Send) -> None:
    """A deferred middleware's app: the request may go on, answered through ``send`` (which
    adds the middleware's headers and settles before the last chunk); held until the route
    has answered, so what the middleware does after its app (a settle, freeing slots) comes
    after the response, as for a route it wraps."""
    step = _STEP.get()
    if step is None:  # pragma: no cover - only ever run inside Handoff.hit's task
        raise RuntimeError("a deferred porch limit ran outside its route")
    step.going.set_result(send)
    await step.done.wait()


def _deferred_key(fallback: KeyFunc) -> KeyFunc:
    """The key a deferred declaration resolved for the running request; ``fallback`` (the
    installer's key, else the peer host) when it resolved None (an anonymous caller)."""

    def key(scope: Scope) -> Any:
        step = _STEP.get()
        if step is None or step.key is None:
            return fallback(scope)
        return step.key

    return key


class Handoff:
    """The deferred limits of one request to a guarded route, and the send its response
    goes through.

    The guard makes one per request (only for a route with a deferred limit in force) and
    sends the route's response through :meth:`forward`; a deferred declaration calls
    :meth:`hit` with its key. Each hit's middleware runs in a task: if it lets the request
    go on, the send it hands on (with its headers) becomes the response's; if it answers
    (429, 503, 400), the declaration raises :class:`Answered`. When the route is done the
    guard releases the middlewares and waits for each (their settles and vacates).
    """

    __slots__ = ("answered", "done", "limiters", "send", "tasks")

    def __init__(self, limiters: Mapping[int, RateLimitMiddleware], send: Send) -> None:
        self.limiters = limiters
        self.send = send
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.answered = False

    async def forward(self, message: Message) -> None:
        await self.send(message)

    def holds(self, declaration: object) -> bool:
        """Whether ``declaration`` is in force for this request."""
        return id(declaration) in self.limiters

    async def hit(
        self, declaration: object, scope: Scope, receive: Receive, key: str | None
    ) -> None:
        """Count this request under ``key`` as ``declaration``'s middleware does; returns if
        it may go on, raises :class:`Answered` when the middleware answered, or what the
        middleware raised (a refusal the app's own handler shapes)."""
        limiter = self.limiters.get(id(declaration))
        if limiter is None:  # switched off, or overridden, for this request
            return
        loop = asyncio.get_running_loop()
        step = _Step(key, loop.create_future(), self.done)
        token = _STEP.set(step)
        try:
            task = loop.create_task(limiter(scope, receive, self.send))
        finally:
            _STEP.reset(token)
        self.tasks.append(task)
        await asyncio.wait((task, step.going), return_when=asyncio.FIRST_COMPLETED)
        if step.going.done():
            self.send = step.going.result()
            return
        task.result()  # a refusal raised for the app's handler
        self.answered = True
        raise Answered

    async def finish(self) -> None:
        """Release the middlewares that let the request go on, and wait until each is done
        (shielded: a cancelled request still frees its slots and applies its settle)."""
        if self.tasks:
            self.done.set()
            await asyncio.shield(asyncio.gather(*self.tasks, return_exceptions=True))


class _RouteRule(Rule):
    """A rule that always applies (the router already chose the route), named for its route."""

    __slots__ = ("claimed", "route")

    route: str
    claimed: tuple[object, ...] | None

    def __init__(
        self,
        limits: tuple[Limit, ...],
        *,
        route: str,
        derived: str | None,
        claimed: tuple[object, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(limits, **kwargs)
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "claimed", claimed)
        if derived is not None:
            # Derived from the route, not chosen: any path may be in it, however long.
            object.__setattr__(self, "name", derived)

    def signature(self) -> tuple[object, ...]:
        if self.claimed is not None:
            # A part of the route's installed rule (some of its declarations off or
            # overridden): the same namespace, already claimed by the whole.
            return self.claimed
        if self.shared:
            return super().signature()
        return ("route", self.route, super().signature()[-1])

    def describe(self) -> str:
        return f"the route limit on {self.route}"


# What a request to a guarded route runs: the chain, the declarations it passes, and the
# deferred limits' middlewares by declaration.
_Chain = tuple[ASGIApp, frozenset[int], Mapping[int, RateLimitMiddleware]]

# Chains built for other sets of active declarations (some off, or overridden) per route.
_MAX_CHAINS = 64


class _Guard:
    """A route's app behind the middlewares its declarations make, over one pool.

    Built for every declaration at install (which claims the counter namespaces and
    validates everything). A request normally runs that chain; when a declaration is
    switched off (``enabled``), or the app's ``dependency_overrides`` replace one of
    its dependencies (or a dependency leading to it), the request runs a chain built
    for the declarations still in force (cached), and with none, the route's app
    itself. Every declaration is marked as passed (GUARDS), so the endpoint's and the
    dependencies' never-installed checks are satisfied.
    """

    __slots__ = (
        "_app",
        "_chains",
        "_declared",
        "_enabled",
        "_full",
        "_ids",
        "_limiters",
        "_names",
        "_overrides",
        "_settings",
    )

    def __init__(
        self,
        app: ASGIApp,
        declared: list[Declared],
        *,
        enabled: bool,
        overrides: Any,
        **settings: Any,
    ) -> None:
        self._app = app
        self._declared = tuple(declared)
        self._enabled = enabled
        self._overrides = overrides  # the dependency_overrides provider (FastAPI), or None
        self._settings = settings
        # The name and the claimed signature of each group of the whole chain's limits.
        self._names: dict[tuple[object, ...], tuple[str, tuple[object, ...]]] = {}
        self._ids = frozenset(id(d.declaration) for d in declared)
        self._full, self._limiters = self._build([d.declaration for d in declared], whole=True)
        self._chains: dict[tuple[int, ...], _Chain] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chain, ids = self._full, self._ids
        limiters: Mapping[int, RateLimitMiddleware] = self._limiters
        if not self._enabled:
            chain, limiters = self._app, {}
        elif self._changed():
            chain, ids, limiters = self._partial()
        token = GUARDS.set(GUARDS.get() | ids)
        try:
            if limiters:
                await _handing_off(chain, limiters, scope, receive, send)
            else:
                await chain(scope, receive, send)
        finally:
            GUARDS.reset(token)

    def _changed(self) -> bool:
        """Whether a declaration is off, or the app overrides any dependency (the usual
        answer, False, costs a look at each declaration and at one dict)."""
        for declared in self._declared:
            if not declared.declaration.enabled:
                return True
        provider = self._overrides
        return provider is not None and bool(getattr(provider, "dependency_overrides", None))

    def _in_force(self) -> list[Declaration]:
        """The declarations this request runs: enabled ones, as the overrides leave them."""
        provider = self._overrides
        overrides: dict[Any, Any] = (
            getattr(provider, "dependency_overrides", None) or {} if provider is not None else {}
        )
        active: list[Declaration] = []
        for declared in self._declared:
            declaration: Declaration | None = declared.declaration
            if declared.via is not None and overrides:
                declaration = _overridden(declared, overrides)
            if declaration is not None and declaration.enabled:
                active.append(declaration)
        return active

    def _partial(self) -> _Chain:
        active = self._in_force()
        signature = tuple(id(d) for d in active)
        found = self._chains.get(signature)
        if found is not None:
            return found
        chain, limiters = self._build(active, whole=False) if active else (self._app, {})
        if len(self._chains) >= _MAX_CHAINS:
            self._chains.clear()
        found = (chain, self._ids | frozenset(signature), limiters)
        self._chains[signature] = found
        return found

    def _build(
        self, declared: list[Declaration], *, whole: bool
    ) -> tuple[ASGIApp, dict[int, RateLimitMiddleware]]:
        """The middlewares of ``declared`` around the route's app: rate limits outside
        idempotency (a refused request never claims a key), unless the idempotency
        declaration says replays do not count. Deferred limits' middlewares are not in
        the chain: they are returned by declaration, each run by its declaration inside
        the route (so inside idempotency: a replay never counts against them)."""
        settings = self._settings
        pool: KeyPool = settings["pool"]
        path: str = settings["path"]
        websocket: bool = settings["websocket"]
        methods: Iterable[str] | None = settings["methods"]
        normalized = None if methods is None else sorted({normalize_method(m) for m in methods})
        route = ("WS" if websocket else "+".join(normalized or ["*"])) + ":" + path
        limits = [d for d in declared if isinstance(d, RouteLimit)]
        idempotency = [d for d in declared if isinstance(d, RouteIdempotency)]
        if len(idempotency) > 1:
            raise ConfigurationError(f"route {route} declares idempotency more than once")
        keyed: Callable[[ASGIApp], ASGIApp] | None = None
        if idempotency:
            keyed = _idempotency(idempotency[0], pool, route, path, websocket, normalized)
        # A deferred limit's middleware answers through the send the route's app is given
        # (inside idempotency and the other limits), as a middleware there would.
        inner = _Entry(self._app) if any(d.deferred for d in limits) else self._app
        replays_free = keyed is not None and not idempotency[0].count_replays
        if keyed is not None and not replays_free:
            inner = keyed(inner)
        # Limits declared with the same key and options are one rule: checked all-or-nothing.
        # A deferred limit is a rule of its own (its declaration runs it).
        groups: dict[tuple[object, ...], list[RouteLimit]] = {}
        limiters: dict[int, RateLimitMiddleware] = {}
        for declared_limit in limits:
            if declared_limit.deferred and websocket:
                raise ConfigurationError(
                    f"route {route}: a limit keyed by a dependency cannot be declared on a"
                    " WebSocket route; key it by a function of the scope (key=callable)"
                )
            group: tuple[object, ...] = (
                id(declared_limit) if declared_limit.deferred else None,
                id(declared_limit.key),
                declared_limit.name,
                declared_limit.shared,
                declared_limit.dry_run,
                declared_limit.fail_open,
                tuple(map(id, declared_limit.exempt)),
                # A cost, a settle, levels and plans are the rule's: only alike ones merge.
                declared_limit.cost
                if isinstance(declared_limit.cost, int)
                else id(declared_limit.cost),
                declared_limit.settle,
                tuple((level, id(key)) for level, key in declared_limit.levels),
                id(declared_limit.plans),
            )
            groups.setdefault(group, []).append(declared_limit)
        for i, (group, members) in enumerate(reversed(list(groups.items()))):
            first = members[0]
            named = self._names.get(group)
            claimed = None
            derived = None
            if named is not None and not whole:
                derived, claimed = named  # this group's namespace in the whole chain
            elif first.name is None:
                derived = f"route:{route}" + (f"#{len(groups) - i}" if len(groups) > 1 else "")
                if not whole:  # a group only an override brought: never one of the whole's
                    derived = f"route:{route}#override{i + 1}"
            rule = _RouteRule(
                # The same limit declared twice (on a router and on its route) is counted once.
                tuple(dict.fromkeys(limit for member in members for limit in member.limits)),
                route=route,
                derived=derived,
                claimed=claimed,
                name=first.name,
                shared=first.shared,
                websocket=websocket,
                cost=first.cost,
                settle=first.settle,
                levels=dict(first.levels),
                plans=first.plans,
            )
            if whole:
                self._names[group] = (rule.name, rule.signature())
            key: KeyFunc | None = first.key if first.key is not None else settings["key"]
            if first.deferred:
                key = _deferred_key(key if key is not None else ClientIdentity())
            limiter = RateLimitMiddleware(
                _go_on if first.deferred else inner,
                pool=pool,
                rules=rule,
                key=key,
                exempt=first.exempt,
                dry_run=first.dry_run,
                fail_open=first.fail_open,
                on_refused=settings["on_refused"],
                headers=settings["headers"],
            )
            if first.deferred:
                limiters[id(first)] = limiter
            else:
                inner = limiter
        if keyed is not None and replays_free:
            inner = keyed(inner)
        return inner, limiters


class _Entry:
    """The route's app, entered with a :class:`Handoff`: what it sends goes through the
    send the deferred limits' middlewares hand on."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handoff = HANDOFF.get()
        if handoff is None:  # pragma: no cover - the guard always sets one with this chain
            await self.app(scope, receive, send)
            return
        handoff.send = send
        await self.app(scope, receive, handoff.forward)


async def _handing_off(
    chain: ASGIApp,
    limiters: Mapping[int, RateLimitMiddleware],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """Run ``chain`` with a :class:`Handoff` for its deferred limits in force."""
    handoff = Handoff(limiters, send)
    token = HANDOFF.set(handoff)
    try:
        await chain(scope, receive, send)
    except Answered:
        if not handoff.answered:  # pragma: no cover - only Handoff.hit raises it
            raise
    finally:
        HANDOFF.reset(token)
        await handoff.finish()


def _overridden(declared: Declared, overrides: dict[Any, Any]) -> Declaration | None:
    """What FastAPI runs for a dependency declaration under ``overrides``: itself, its
    replacement if that is a porch declaration of the same kind, or nothing (another
    callable replaces it, or replaces every dependency leading to it)."""
    declaration = declared.declaration
    reached = any(
        not any(call in overrides for call in chain if _hashable(call))
        for chain in declared.via or ()
    )
    if not reached:
        return None
    replacement: object = overrides.get(declaration, declaration)
    if isinstance(replacement, _kind(declaration)):
        return replacement
    return None


def _kind(declaration: Declaration) -> type[RouteLimit] | type[RouteIdempotency]:
    return RouteLimit if isinstance(declaration, RouteLimit) else RouteIdempotency


def _hashable(call: object) -> bool:
    try:
        hash(call)
    except TypeError:
        return False
    return True


def _idempotency(
    declared: RouteIdempotency,
    pool: KeyPool,
    route: str,
    path: str,
    websocket: bool,
    normalized: list[str] | None,
) -> Callable[[ASGIApp], ASGIApp]:
    """The idempotency middleware of a route, validated now, as a wrapper of its app."""
    if websocket:
        raise ConfigurationError(f"idempotency cannot be declared on a WebSocket route {path}")
    honoured = declared.methods or (_UNSAFE & set(normalized or _UNSAFE))
    if not honoured:
        raise ConfigurationError(
            f"idempotency on route {route} has no unsafe method to honour; pass methods="
        )
    rule = IdempotencyRule(methods=honoured, policy=declared.policy)

    def wrap(app: ASGIApp) -> ASGIApp:
        return IdempotencyMiddleware(
            app,
            pool=pool,
            rules=rule,
            scope=declared.scope,
            quota=declared.quota,
            identity=declared.identity,
            integrity_key=declared.integrity_key,
        )

    return wrap


def guard(
    app: ASGIApp,
    *,
    pool: KeyPool,
    path: str,
    methods: Iterable[str] | None,
    websocket: bool,
    declared: list[Declared],
    key: KeyFunc | None,
    on_refused: RefusalFactory,
    headers: HeaderStyle = "both",
    enabled: bool = True,
    overrides: Any = None,
) -> ASGIApp:
    """``app`` (a route's) behind the middlewares of its declarations (see _Guard). Every
    namespace is claimed on ``pool`` now. ``overrides`` is the object whose
    ``dependency_overrides`` FastAPI honours for this route (the app, or a router)."""
    return _Guard(
        app,
        declared,
        enabled=enabled,
        overrides=overrides,
        pool=pool,
        path=path,
        methods=methods,
        websocket=websocket,
        key=key,
        on_refused=on_refused,
        headers=headers,
    )
