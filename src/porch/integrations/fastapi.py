"""Per-route limits and idempotency for FastAPI, as dependencies::

    from fastapi import Depends, FastAPI
    from porch.integrations.fastapi import Idempotency, RateLimit, install

    @app.post("/users/{id}/follow",
              dependencies=[Depends(RateLimit("5/minute")), Depends(Idempotency())])
    async def follow(id: int): ...

    install(app, pool)      # once the routes are added; the app-level middlewares' pool

The dependencies declare; ``install`` wraps each declaring route's ASGI app
with porch's guard (:mod:`porch.integrations._routes`), claims the counter namespaces, and
documents 429/503 and ``Idempotency-Key`` in the OpenAPI schema. A dependency
whose route was never installed refuses with 503 (and an error log) rather
than let the request through unlimited. The decorators of
:mod:`porch.integrations.starlette` work on FastAPI endpoints too.
"""

# No "from __future__ import annotations": FastAPI reads the dependencies' signatures at
# run time, and before 0.11x it could not resolve string annotations on a callable instance.

import inspect
import logging
from collections.abc import Iterable
from typing import Annotated, Any

try:
    # First: without FastAPI (and so without Starlette) the message names this extra.
    from fastapi import Header, HTTPException, Request, params
except ImportError as exc:  # pragma: no cover - exercised without fastapi installed
    raise ImportError(
        "porch.integrations.fastapi needs FastAPI: pip install 'porch[fastapi]'"
    ) from exc

from .._types import Message
from ..clock import SystemClock
from ..idempotency._policy import IdempotencyPolicy
from ..ratelimit._rules import Limit
from ._routes import GUARDS, HANDOFF, RouteIdempotency, RouteLimit
from .starlette import RateLimitExceeded, idempotent, install, limit

__all__ = ["Idempotency", "RateLimit", "RateLimitExceeded", "idempotent", "install", "limit"]

logger = logging.getLogger("porch.routes")


def _check(declaration: RouteLimit | RouteIdempotency, request: Request) -> None:
    if id(declaration) in GUARDS.get():
        return
    declaration.log.event(
        logging.ERROR,
        request.url.path,
        SystemClock().monotonic(),
        60.0,
        "porch: route %s declares %s but was never installed; call"
        " porch.integrations.fastapi.install(app, pool) after adding the routes (answering 503)",
        request.url.path,
        type(declaration).__name__,
        outcome="not installed",
        status=503,
    )
    raise HTTPException(503, "this route's limits are not installed")


class RateLimit(RouteLimit):
    """A rate limit on a route, as a dependency: ``Depends(RateLimit("5/minute", key=...))``.
    The arguments are :func:`porch.integrations.starlette.limit`'s, and ``key`` may also be
    a dependency, ``key=Depends(user_key)``: its result (a str; None: the default key, the
    peer host) is the client's key, so it can be what the app's own auth dependencies
    resolved. The request is then counted inside this dependency, once FastAPI has
    resolved that one (and, cached per request, the auth it depends on)."""

    __slots__ = ()

    def __new__(
        cls, rate: str | Limit | Iterable[Limit | str], *, key: Any = None, **settings: Any
    ) -> "RateLimit":
        chosen = _KeyedRateLimit if isinstance(key, params.Depends) else cls
        return super().__new__(chosen)

    async def __call__(self, request: Request) -> None:
        _check(self, request)


class _KeyedRateLimit(RateLimit):
    """A :class:`RateLimit` keyed by a dependency's result (deferred: see _routes.Handoff)."""

    __slots__ = ("dependency",)
    deferred = True

    def __init__(
        self, rate: str | Limit | Iterable[Limit | str], *, key: Any = None, **settings: Any
    ) -> None:
        super().__init__(rate, **settings)
        self.dependency: params.Depends = key

    @property
    def __signature__(self) -> inspect.Signature:
        # What FastAPI reads to resolve this dependency's own: the request and the key.
        return inspect.Signature(
            [
                inspect.Parameter(
                    "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request
                ),
                inspect.Parameter(
                    "key",
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    annotation=Any,
                    default=self.dependency,
                ),
            ]
        )

    async def __call__(self, request: Request, key: Any = None) -> None:
        _check(self, request)
        handoff = HANDOFF.get()
        if handoff is None or not handoff.holds(self):
            return  # switched off, or overridden, for this request
        if key is not None and not isinstance(key, str):
            self.log.event(
                logging.ERROR,
                ("key", request.url.path),
                SystemClock().monotonic(),
                60.0,
                "porch: the key dependency of the rate limit on %s returned %s, not a str"
                " (or None); answering 503",
                request.url.path,
                type(key).__name__,
                outcome="bad key",
                status=503,
            )
            raise HTTPException(503, "this route's rate-limit key is misconfigured")
        await handoff.hit(self, request.scope, _body_replayed(request), key)


def _body_replayed(request: Request) -> Any:
    """The request's receive for a limit counted after FastAPI read the body: the body it
    read first (a cost may read it), then the connection's own messages."""
    first = True

    async def receive() -> Message:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": await request.body(), "more_body": False}
        message: Message = await request.receive()
        return message

    return receive


class Idempotency(RouteIdempotency):
    """``Idempotency-Key`` honoured on a route, as a dependency: ``Depends(Idempotency())``.
    The arguments are :func:`porch.integrations.starlette.idempotent`'s; the header is in the schema
    (required there with ``required=True``)."""

    __slots__ = ()
    documents_header = True

    def __new__(cls, **settings: Any) -> "Idempotency":
        # The schema is read from __call__'s signature: a required key needs its own.
        required = settings.get("required")
        if required is None:  # as the policy says
            policy = settings.get("policy")
            required = isinstance(policy, IdempotencyPolicy) and policy.required
        chosen = _RequiredIdempotency if required else cls
        return super().__new__(chosen)

    async def __call__(
        self,
        request: Request,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                description="Resending with the same key replays the stored response.",
                max_length=255,
            ),
        ] = None,
    ) -> None:
        _check(self, request)


class _RequiredIdempotency(Idempotency):
    __slots__ = ()

    async def __call__(  # type: ignore[override]
        self,
        request: Request,
        idempotency_key: Annotated[
            str,
            Header(
                alias="Idempotency-Key",
                description="Required. Resending with the same key replays the stored response.",
                max_length=255,
            ),
        ],
    ) -> None:
        _check(self, request)
