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

import logging
from typing import Annotated, Any

try:
    # First: without FastAPI (and so without Starlette) the message names this extra.
    from fastapi import Header, HTTPException, Request
except ImportError as exc:  # pragma: no cover - exercised without fastapi installed
    raise ImportError(
        "porch.integrations.fastapi needs FastAPI: pip install 'porch[fastapi]'"
    ) from exc

from ..clock import SystemClock
from ..idempotency._policy import IdempotencyPolicy
from ._routes import GUARDS, RouteIdempotency, RouteLimit
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
    The arguments are :func:`porch.integrations.starlette.limit`'s."""

    __slots__ = ()

    async def __call__(self, request: Request) -> None:
        _check(self, request)


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
