"""WSGI apps (Flask, Django) behind porch's middlewares, on one background event loop.

The limiter and idempotency are the ASGI middlewares, unchanged: a WSGI
request becomes an ASGI scope (:mod:`porch.integrations.wsgi._environ`) and runs through
them on an event loop thread that this package starts at the first request (in
each worker process, after any fork) and stops at exit, closing the pool first
(:mod:`porch.integrations.wsgi._loop`). The WSGI app itself runs on the server's own thread,
never on the loop: the ASGI side asks that thread for what it needs — a chunk
of the request body, the app's response head, its next body chunk — and hands
back what the client gets, one message at a time (:mod:`porch.integrations.wsgi._exchange`).
So a response streams as the app produces it, the request body is read only if
a middleware or the app reads it, and the idempotency middleware captures the
response (status, headers, the body iterable, whose ``close()`` is always
called) exactly as under ASGI.

Counts stay exact across processes (gunicorn's sync workers, say) because
every decision is the shared store's. One :class:`WSGIMiddleware` per pool:
the pool lives on this middleware's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..._responses import problem
from ..._types import ASGIApp
from ...errors import ConfigurationError, PoolClosedError
from ...pool._pool import KeyPool
from ._environ import status_line
from ._exchange import Exchange, StartResponse, WSGIApp, wsgi_app
from ._loop import BackgroundLoop

__all__ = ["WSGIApp", "WSGIMiddleware"]

logger = logging.getLogger("porch.integrations.wsgi")


class WSGIMiddleware:
    """Put porch's ASGI middlewares in front of a WSGI app.

    ``wrap`` builds the middleware stack around the ASGI side of the app it is
    given, e.g. ``lambda app: RateLimitMiddleware(IdempotencyMiddleware(app,
    pool=pool), pool=pool, rules=...)``; ``pool`` is the pool those middlewares
    use (this middleware runs it and closes it at exit). The ASGI scope carries
    the WSGI environ as ``scope["wsgi.environ"]``, for key and scope functions.
    ``enabled=False`` calls the app directly (an off switch for tests).
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        pool: KeyPool,
        wrap: Callable[[ASGIApp], ASGIApp],
        enabled: bool = True,
    ) -> None:
        if not callable(app):
            raise ConfigurationError("app must be a WSGI application (a callable)")
        if not isinstance(pool, KeyPool):
            raise ConfigurationError("pool must be a porch KeyPool")
        self.app = app
        self.pool = pool
        self.enabled = enabled
        self._asgi = wrap(wsgi_app)
        self._loop = BackgroundLoop(pool)

    def close(self) -> None:
        """Close the pool and stop the background loop (also done at exit)."""
        self._loop.stop()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not self.enabled:
            return self.app(environ, start_response)
        try:
            loop = self._loop.get()
        except PoolClosedError as exc:
            logger.error("porch: %s; answering 503", exc)
            answer = problem(503, str(exc), cause="unavailable", headers=[(b"retry-after", b"1")])
            start_response(
                status_line(503),
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.headers],
            )
            return [answer.body]
        exchange = Exchange(self.app, self._asgi, environ, start_response)
        return exchange.run(loop)
