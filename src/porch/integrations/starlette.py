"""Per-route limits and idempotency for Starlette (and FastAPI) apps.

Declare on the endpoint, install once the routes are defined::

    from porch.integrations.starlette import idempotent, install, limit

    @limit("5/minute")
    @idempotent()
    async def follow(request): ...

    app = Starlette(routes=[Route("/users/{id}/follow", follow, methods=["POST"])])
    install(app, pool)        # the same pool the app-level middlewares use

Each declared route's ASGI app is wrapped by a guard (:mod:`porch.integrations._routes`), so
only requests the router hands to that route count — never a 404, a 405 or a
trailing-slash redirect. A refusal is raised as :class:`RateLimitExceeded` (an
``HTTPException``) when the app has a handler for it or for status 429, and
otherwise answered exactly as :class:`~porch.RateLimitMiddleware` answers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

from .. import errors
from .._eventlog import EventLog
from .._responses import problem
from ..clock import SystemClock
from ..errors import ConfigurationError, StoreError
from ..idempotency._keys import ScopeFunc
from ..idempotency._middleware import DEFAULT_QUOTA
from ..idempotency._policy import IdempotencyPolicy
from ..identity import KeyFunc
from ..pool._pool import KeyPool
from ..ratelimit._decisions import HeaderStyle, Refusal, check_header_style
from ..ratelimit._middleware import Exemption, RefusalFactory
from ..ratelimit._rules import CostFunc, LevelKey, Limit, Plans
from ..store.base import Quota
from ._routes import (
    GUARDS,
    Declaration,
    Declared,
    RouteIdempotency,
    RouteLimit,
    guard,
    raising_refusal,
)

try:
    from starlette.exceptions import HTTPException
    from starlette.routing import Host, Mount, Route, WebSocketRoute
except ImportError as exc:  # pragma: no cover - exercised without starlette installed
    raise ImportError(
        "porch.integrations.starlette needs Starlette: pip install 'porch[starlette]'"
    ) from exc

__all__ = ["RateLimitExceeded", "idempotent", "install", "limit"]

logger = logging.getLogger("porch.routes")

E = TypeVar("E", bound=Callable[..., Any])
_DECLARED = "__porch_route__"
# Set on what install() guarded (a route, or FastAPI's context of an included one).
_GUARDED = "_porch_installed"
# How deep dependencies are searched for declarations (FastAPI's trees are shallow).
_DEPTH = 32


class RateLimitExceeded(errors.RateLimitExceeded, HTTPException):
    """Raised when a route-level limit refuses a request and the app handles it (429, with the
    rate-limit headers in ``headers``; ``refusal`` says which policies were violated)."""

    def __init__(self, refusal: Refusal) -> None:
        errors.RateLimitExceeded.__init__(self, refusal)
        HTTPException.__init__(
            self,
            429,
            detail=str(errors.RateLimitExceeded.__str__(self)),
            headers=self.rate_limit_headers,
        )

    def __str__(self) -> str:
        return f"rate limit exceeded; retry in {self.refusal.retry_after} s"


def limit(
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
) -> Callable[[E], E]:
    """Declare a rate limit on an endpoint (function or endpoint class; HTTP or WebSocket).

    Several rates in one declaration (``"100/day; 10/second"``) are one rule,
    checked all-or-nothing; so are several ``@limit`` with the same key and options.
    ``exempt``: predicates on the request's scope (sync or async) that exempt it;
    ``enabled=False`` declares the limit switched off. ``cost``, ``settle``, ``levels``
    and ``plans`` are :class:`~porch.Rule`'s (a cost per request, settled by the handler
    with :func:`porch.ratelimit.settle`; keys of other levels; limits per plan).
    """
    declaration = RouteLimit(
        rate,
        key=key,
        name=name,
        shared=shared,
        dry_run=dry_run,
        fail_open=fail_open,
        exempt=exempt,
        enabled=enabled,
        cost=cost,
        settle=settle,
        levels=levels,
        plans=plans,
    )
    return functools.partial(_declare, declaration)


def idempotent(
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
) -> Callable[[E], E]:
    """Honour ``Idempotency-Key`` on an endpoint's unsafe methods, handled as ``policy``
    says (an :class:`~porch.IdempotencyPolicy`; the other settings as in
    :class:`~porch.IdempotencyMiddleware`).

    ``count_replays``: whether a replay counts against the route's rate limits (True:
    the limits run first, for every request; False: a replay, a 409 or a 422 answers
    before them and consumes nothing). ``enabled=False`` declares it switched off.
    """
    declaration = RouteIdempotency(
        policy=policy,
        required=required,
        methods=methods,
        digest_headers=digest_headers,
        scope=scope,
        ttl=ttl,
        wait_timeout=wait_timeout,
        max_body=max_body,
        max_stored=max_stored,
        quota=quota,
        count_replays=count_replays,
        enabled=enabled,
        identity=identity,
        integrity_key=integrity_key,
    )
    return functools.partial(_declare, declaration)


def _declare(declaration: RouteLimit | RouteIdempotency, endpoint: E) -> E:
    declared = getattr(endpoint, _DECLARED, None)
    if declared is None:
        declared = []
        endpoint = _checked(endpoint, declared)
        setattr(endpoint, _DECLARED, declared)
    declared.append(declaration)
    return endpoint


def _checked(endpoint: E, declared: list[RouteLimit | RouteIdempotency]) -> E:
    """An endpoint function that refuses (503, logged) when its route was never installed: a
    declared limit that silently does not apply would be worse than none. (An endpoint class
    is returned as it is: install() finds its declarations all the same.)"""
    if not inspect.isfunction(endpoint):
        return endpoint
    log = EventLog(logger)
    clock = SystemClock()

    def guarded() -> bool:
        if not GUARDS.get().isdisjoint(map(id, declared)):
            return True
        log.event(
            logging.ERROR,
            "not installed",
            clock.monotonic(),
            60.0,
            "porch: %r declares limits or idempotency but its route was never installed;"
            " call install(app, pool) (porch.integrations.starlette) after adding the routes"
            " (answering 503)",
            endpoint.__qualname__,
            outcome="not installed",
            status=503,
        )
        return False

    if inspect.iscoroutinefunction(endpoint):

        @functools.wraps(endpoint)
        async def checked(*args: Any, **kwargs: Any) -> Any:
            if not guarded():
                return _not_installed()
            return await endpoint(*args, **kwargs)

        wrapper: Callable[..., Any] = checked
    else:

        @functools.wraps(endpoint)
        def checked_sync(*args: Any, **kwargs: Any) -> Any:
            if not guarded():
                return _not_installed()
            return endpoint(*args, **kwargs)

        wrapper = checked_sync
    with contextlib.suppress(NameError):
        # The endpoint's parameters with their annotations resolved in its own module:
        # FastAPI before 0.11x resolves string annotations in the wrapper's (this one).
        wrapper.__signature__ = inspect.signature(endpoint, eval_str=True)  # type: ignore[attr-defined]
    return cast(E, wrapper)


def _not_installed() -> Any:
    from starlette.responses import Response

    response = problem(503, "this route's limits are not installed", cause="configuration")
    return Response(response.body, 503, media_type="application/problem+json")


def install(
    app: Any,
    pool: KeyPool,
    *,
    key: KeyFunc | None = None,
    headers: HeaderStyle = "both",
    manage_pool: bool = True,
    enabled: bool = True,
) -> int:
    """Guard every route of ``app`` (Starlette or FastAPI: included routers, mounts, hosts and
    mounted apps too) that declares limits or idempotency; returns how many. Call it once the
    routes are added.

    Every counter namespace is claimed on ``pool`` here, so a name clash is a
    ConfigurationError now, not at the first request. ``key`` is the default client
    key of route limits (default: the peer host), ``headers`` the rate-limit fields their
    responses carry (see :class:`~porch.RateLimitMiddleware`). At startup (the app's
    lifespan) the routes are walked again, so routes added after this call are guarded
    too; ``manage_pool`` also opens the pool then and closes it at shutdown.

    ``enabled=False`` installs every route switched off, as the middlewares' off switch:
    each runs unlimited and never opens the store (everything is still validated).
    A declaration is switched off alone with its ``enabled`` attribute, and a FastAPI
    dependency declaration by ``app.dependency_overrides`` (a replacement that is itself
    a porch declaration of the same kind applies instead).
    """
    if not isinstance(pool, KeyPool):
        raise ConfigurationError("pool must be a porch KeyPool")
    check_header_style(headers)
    routes = getattr(app, "routes", None)
    if routes is None:
        raise ConfigurationError(f"install() needs a Starlette or FastAPI app, got {app!r}")
    on_refused = raising_refusal(RateLimitExceeded)

    def guard_all() -> int:
        guarded = 0
        for route, path in _walk(app.routes, ""):
            if _guard(route, path, pool, key, headers, on_refused, enabled):
                guarded += 1
        if guarded and hasattr(app, "openapi_schema"):
            app.openapi_schema = None  # FastAPI caches its schema: rebuild with the additions
        return guarded

    guarded = guard_all()
    router = getattr(app, "router", None)
    if router is not None and hasattr(router, "lifespan_context"):
        router.lifespan_context = _at_startup(
            router.lifespan_context, guard_all, pool if manage_pool and enabled else None
        )
    return guarded


def _guard(
    route: Any,
    path: str,
    pool: KeyPool,
    key: KeyFunc | None,
    headers: HeaderStyle,
    on_refused: RefusalFactory,
    enabled: bool,
) -> bool:
    """Wrap ``route.app`` in porch's guard if it declares anything; whether it is guarded."""
    if getattr(route, _GUARDED, False):
        return True
    declared = _declarations(route)
    if not declared:
        return False
    websocket = isinstance(route, WebSocketRoute)
    route.app = guard(
        route.app,
        pool=pool,
        path=path,
        methods=None if websocket else getattr(route, "methods", None),
        websocket=websocket,
        declared=declared,
        key=key,
        on_refused=on_refused,
        headers=headers,
        enabled=enabled,
        overrides=getattr(route, "dependency_overrides_provider", None),
    )
    setattr(route, _GUARDED, True)
    limits = [d.declaration for d in declared if isinstance(d.declaration, RouteLimit)]
    idempotency = [d.declaration for d in declared if isinstance(d.declaration, RouteIdempotency)]
    _document(route, limits, idempotency, headers)
    return True


def _walk(routes: Iterable[Any], prefix: str) -> Iterable[tuple[Any, str]]:
    """Every route that runs an endpoint, with its full path template (under a ``Host``, the
    host pattern first: the same path on two hosts is two routes): inside mounts, hosts
    and mounted apps (also behind the app's own middlewares), and inside FastAPI's
    included routers.

    What is yielded has the ``app`` the router calls for that route: the route itself, or,
    for a route of a router FastAPI includes lazily (0.13x and newer), FastAPI's context for
    that inclusion (its own app, full path and dependencies: the router's and the
    ``include_router`` call's too). Older FastAPI copies included routes into the app.
    A route of another kind that declares anything is a ConfigurationError: porch could
    not guard it, and it must not run unlimited.
    """
    for route in routes:
        if isinstance(route, Mount):
            yield from _walk(_mounted_routes(route), prefix + route.path)
        elif isinstance(route, Host):
            yield from _walk(_mounted_routes(route), route.host + prefix)
        elif isinstance(route, Route | WebSocketRoute):
            yield route, prefix + route.path
        else:
            contexts = getattr(route, "effective_route_contexts", None)
            if contexts is not None:
                for context in contexts():
                    inner = context.starlette_route
                    if inner is None:  # an APIRoute: its context holds this inclusion's app
                        yield context, prefix + context.path
                    else:  # a plain route, mount or host, copied for this inclusion
                        yield from _walk([inner], prefix)
            elif hasattr(route, "endpoint") and _declarations(route):
                raise ConfigurationError(
                    f"porch cannot install the limits or idempotency declared on"
                    f" {route!r} (a {type(route).__qualname__}): install() guards Route,"
                    " WebSocketRoute and FastAPI's routes, inside Mount and Host; declare"
                    " them on one of those, or use the app-level middlewares"
                )


def _mounted_routes(route: Mount | Host) -> list[Any]:
    """The routes of a mount or host: of its app, found behind the app's own middlewares
    (pure ASGI middlewares keep the app they wrap as ``.app``)."""
    routes = route.routes
    if routes:
        return list(routes)
    app = getattr(route, "_base_app", None) or getattr(route, "app", None)
    for _ in range(_DEPTH):
        if app is None:
            break
        found = getattr(app, "routes", None)
        if isinstance(found, list | tuple) and found:
            return list(found)
        app = getattr(app, "app", None)
    return []


def _declarations(route: Any) -> list[Declared]:
    """Declarations on the endpoint (decorators) and in FastAPI dependencies, in order, each
    dependency with the chains of dependencies that lead to it."""
    found: list[Declared] = [Declared(d) for d in getattr(route.endpoint, _DECLARED, ())]
    dependant = getattr(route, "dependant", None)
    chains: dict[int, tuple[Declaration, list[tuple[Callable[..., Any], ...]]]] = {}
    stack: list[tuple[Any, tuple[Callable[..., Any], ...]]] = [
        (d, ()) for d in getattr(dependant, "dependencies", ())
    ]
    while stack:
        dependency, above = stack.pop(0)
        call = getattr(dependency, "call", None)
        if isinstance(call, RouteLimit | RouteIdempotency):
            chains.setdefault(id(call), (call, []))[1].append(above)
        if call is not None and len(above) < _DEPTH:
            stack.extend((d, (*above, call)) for d in getattr(dependency, "dependencies", ()))
    found.extend(Declared(d, tuple(via)) for d, via in chains.values())
    return found


def _document(
    route: Any,
    limits: list[RouteLimit],
    idempotency: list[RouteIdempotency],
    headers: HeaderStyle,
) -> None:
    """FastAPI: 429 and 503 responses and the Idempotency-Key header in the route's schema."""
    responses = getattr(route, "responses", None)
    if not isinstance(responses, dict):
        return
    from ._openapi import document

    document(route, responses, limits, idempotency, headers)


def _at_startup(
    lifespan: Callable[[Any], AbstractAsyncContextManager[Any]],
    guard_all: Callable[[], int],
    pool: KeyPool | None,
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    """The app's lifespan, which first guards routes added since install() and, given the
    pool, opens it at startup and closes it at shutdown."""

    @asynccontextmanager
    async def with_porch(app: Any) -> AsyncIterator[Any]:
        guard_all()
        async with lifespan(app) as state:
            if pool is None:
                yield state
                return
            try:
                await pool.start()
            except (StoreError, OSError) as exc:
                # As the middlewares do: serve, answer 503 until the store opens.
                logger.error("porch: cannot open the store, answering 503 until it opens: %s", exc)
            try:
                yield state
            finally:
                await pool.close()

    return with_porch
