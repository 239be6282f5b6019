"""Per-route limits and idempotency for Starlette (and FastAPI) apps.

Declare on the endpoint, install once the routes are defined::

    @porch.starlette.limit("5/minute")
    @porch.starlette.idempotent()
    async def follow(request): ...

    app = Starlette(routes=[Route("/users/{id}/follow", follow, methods=["POST"])])
    porch.starlette.install(app, pool)       # the same pool the app-level middlewares use

Each declared route's ASGI app is wrapped by a guard (:mod:`porch.routes`), so
only requests the router hands to that route count — never a 404, a 405 or a
trailing-slash redirect. A refusal is raised as :class:`RateLimitExceeded` (an
``HTTPException``) when the app has a handler for it or for status 429, and
otherwise answered exactly as :class:`~porch.RateLimitMiddleware` answers.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

from . import errors
from .decisions import HeaderStyle, Refusal, check_header_style
from .errors import ConfigurationError, StoreError
from .idempotency import DEFAULT_QUOTA
from .idempotency_keys import ScopeFunc
from .identity import KeyFunc
from .pool import KeyPool
from .responses import problem
from .routes import INSTALLED, RouteIdempotency, RouteLimit, guard, raising_refusal
from .rules import Limit
from .store.base import Quota

try:
    from starlette.exceptions import HTTPException
    from starlette.routing import BaseRoute, Host, Mount, Route, WebSocketRoute
except ImportError as exc:  # pragma: no cover - exercised without starlette installed
    raise ImportError("porch.starlette needs Starlette: pip install 'porch[starlette]'") from exc

__all__ = ["RateLimitExceeded", "idempotent", "install", "limit"]

logger = logging.getLogger("porch.routes")

E = TypeVar("E", bound=Callable[..., Any])
_DECLARED = "__porch_route__"


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
) -> Callable[[E], E]:
    """Declare a rate limit on an endpoint (function or endpoint class; HTTP or WebSocket).

    Several rates in one declaration (``"100/day; 10/second"``) are one rule,
    checked all-or-nothing; so are several ``@limit`` with the same key and options.
    """
    declaration = RouteLimit(
        rate, key=key, name=name, shared=shared, dry_run=dry_run, fail_open=fail_open
    )
    return functools.partial(_declare, declaration)


def idempotent(
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
) -> Callable[[E], E]:
    """Honour ``Idempotency-Key`` on an endpoint's unsafe methods (see IdempotencyMiddleware)."""
    declaration = RouteIdempotency(
        required=required,
        methods=methods,
        digest_headers=digest_headers,
        scope=scope,
        ttl=ttl,
        wait_timeout=wait_timeout,
        max_body=max_body,
        max_stored=max_stored,
        quota=quota,
    )
    return functools.partial(_declare, declaration)


def _declare(declaration: RouteLimit | RouteIdempotency, endpoint: E) -> E:
    declared = getattr(endpoint, _DECLARED, None)
    if declared is None:
        endpoint = _checked(endpoint)
        declared = []
        setattr(endpoint, _DECLARED, declared)
    declared.append(declaration)
    return endpoint


def _checked(endpoint: E) -> E:
    """A coroutine endpoint that refuses (503, logged) when its route was never installed: a
    declared limit that silently does not apply would be worse than none."""
    if not inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)
    async def checked(*args: Any, **kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            scope = getattr(arg, "scope", None)
            if isinstance(scope, Mapping) and "type" in scope:
                if INSTALLED not in scope:
                    return _not_installed(endpoint)
                break
        return await endpoint(*args, **kwargs)

    return cast(E, checked)


def _not_installed(endpoint: object) -> Any:
    logger.error(
        "porch: %r declares limits or idempotency but its route was never installed;"
        " call porch.starlette.install(app, pool) after adding the routes (answering 503)",
        getattr(endpoint, "__qualname__", endpoint),
    )
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
) -> int:
    """Guard every route of ``app`` (Starlette or FastAPI, mounts and hosts included) that
    declares limits or idempotency; returns how many. Call it once the routes are added.

    Every counter namespace is claimed on ``pool`` here, so a name clash is a
    ConfigurationError now, not at the first request. ``key`` is the default client
    key of route limits (default: the peer host), ``headers`` the rate-limit fields their
    responses carry (see :class:`~porch.RateLimitMiddleware`). ``manage_pool`` opens the pool at
    startup and closes it at shutdown through the app's lifespan.
    """
    if not isinstance(pool, KeyPool):
        raise ConfigurationError("pool must be a porch KeyPool")
    check_header_style(headers)
    routes = getattr(app, "routes", None)
    if routes is None:
        raise ConfigurationError(f"install() needs a Starlette or FastAPI app, got {app!r}")
    on_refused = raising_refusal(RateLimitExceeded)
    guarded = 0
    for route, path in _walk(routes, ""):
        if getattr(route, "_porch_installed", False):
            guarded += 1
            continue
        declared = _declarations(route)
        if not declared:
            continue
        limits = [d for d in declared if isinstance(d, RouteLimit)]
        idempotency = [d for d in declared if isinstance(d, RouteIdempotency)]
        websocket = isinstance(route, WebSocketRoute)
        methods = None if websocket else getattr(route, "methods", None)
        route.app = guard(
            route.app,
            pool=pool,
            path=path,
            methods=methods,
            websocket=websocket,
            limits=limits,
            idempotency=idempotency,
            key=key,
            on_refused=on_refused,
            headers=headers,
        )
        route._porch_installed = True
        _document(route, limits, idempotency, headers)
        guarded += 1
    if guarded and hasattr(app, "openapi_schema"):
        app.openapi_schema = None  # FastAPI caches its schema: rebuild with the additions
    if manage_pool and guarded:
        router = getattr(app, "router", None)
        if router is not None and hasattr(router, "lifespan_context"):
            router.lifespan_context = _with_pool(router.lifespan_context, pool)
    return guarded


def _walk(routes: Iterable[BaseRoute], prefix: str) -> Iterable[tuple[Any, str]]:
    for route in routes:
        if isinstance(route, Mount | Host):
            inner = route.routes
            yield from _walk(inner, prefix + (route.path if isinstance(route, Mount) else ""))
        elif isinstance(route, Route | WebSocketRoute):
            yield route, prefix + route.path


def _declarations(route: Any) -> list[RouteLimit | RouteIdempotency]:
    """Declarations on the endpoint (decorators) and in FastAPI dependencies, in order."""
    found: list[RouteLimit | RouteIdempotency] = list(getattr(route.endpoint, _DECLARED, ()))
    dependant = getattr(route, "dependant", None)
    stack = list(getattr(dependant, "dependencies", ()))
    seen: set[int] = set()
    while stack:
        dependency = stack.pop(0)
        call = getattr(dependency, "call", None)
        if isinstance(call, RouteLimit | RouteIdempotency) and id(call) not in seen:
            seen.add(id(call))
            found.append(call)
        stack.extend(getattr(dependency, "dependencies", ()))
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
    from .openapi import document

    document(route, responses, limits, idempotency, headers)


def _with_pool(
    lifespan: Callable[[Any], AbstractAsyncContextManager[Any]], pool: KeyPool
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    @asynccontextmanager
    async def with_pool(app: Any) -> AsyncIterator[Any]:
        async with lifespan(app) as state:
            try:
                await pool.start()
            except (StoreError, OSError) as exc:
                # As the middlewares do: serve, answer 503 until the store opens.
                logger.error("porch: cannot open the store, answering 503 until it opens: %s", exc)
            try:
                yield state
            finally:
                await pool.close()

    return with_pool
