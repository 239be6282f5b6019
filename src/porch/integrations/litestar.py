"""porch as a Litestar plugin: the middlewares, and the pool opened and closed with the app::

    from litestar import Litestar
    from porch import IdempotencyMiddleware, IdempotencyRule, KeyPool, RateLimitMiddleware
    from porch import Rule, SQLiteStore
    from porch.integrations.litestar import PorchPlugin

    pool = KeyPool(SQLiteStore("./porch-data"))
    app = Litestar(
        route_handlers=[...],
        plugins=[PorchPlugin(pool, wrap=lambda app: RateLimitMiddleware(
            IdempotencyMiddleware(app, pool=pool, rules=IdempotencyRule("/orders")),
            pool=pool, rules=Rule("60/minute")))],
    )

Litestar keeps the ASGI lifespan to itself (its middlewares never see it), so the
middlewares alone would open the pool at the first request and never close it: the
plugin opens it at startup (``on_startup``) and closes it at shutdown (``on_shutdown``).
``wrap`` is added after the app's own middlewares, so porch runs inside them (an
authentication middleware's ``scope["user"]`` is there for key and scope functions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._types import ASGIApp
from ..errors import ConfigurationError, StoreError
from ..pool._pool import KeyPool

try:
    import litestar  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without litestar installed
    raise ImportError(
        "porch.integrations.litestar needs Litestar: pip install 'porch[litestar]'"
    ) from exc

if TYPE_CHECKING:
    from litestar.config.app import AppConfig

__all__ = ["PorchPlugin"]

logger = logging.getLogger("porch")


class PorchPlugin:
    """Litestar's init plugin for porch (``Litestar(plugins=[PorchPlugin(pool, wrap=...)])``).

    ``wrap`` builds porch's middlewares around the ASGI app it is given (as for
    :class:`~porch.integrations.wsgi.WSGIMiddleware`); without it, only the pool's
    lifecycle is managed (route handlers or your own middlewares use the pool).
    ``enabled=False`` adds no middleware and never opens the store (for tests).
    """

    __slots__ = ("enabled", "pool", "wrap")

    def __init__(
        self,
        pool: KeyPool,
        *,
        wrap: Callable[[ASGIApp], ASGIApp] | None = None,
        enabled: bool = True,
    ) -> None:
        if not isinstance(pool, KeyPool):
            raise ConfigurationError("pool must be a porch KeyPool")
        if wrap is not None and not callable(wrap):
            raise ConfigurationError(f"wrap must be a callable(app) -> app, got {wrap!r}")
        self.pool = pool
        self.wrap = wrap
        self.enabled = bool(enabled)

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        """Add porch's middlewares and the pool's startup and shutdown to the app's config."""
        if not self.enabled:
            return app_config
        if self.wrap is not None:
            # A callable(app) -> app is a Litestar middleware; the last listed runs innermost.
            middleware: Any = self.wrap  # Litestar types ASGI apps its own way
            app_config.middleware.append(middleware)
        app_config.on_startup.append(self._start)
        app_config.on_shutdown.append(self.pool.close)
        return app_config

    async def _start(self) -> None:
        try:
            await self.pool.start()
        except (StoreError, OSError) as exc:
            # As the middlewares do: serve, and answer 503 until the store opens.
            logger.error("porch: cannot open the store, answering 503 until it opens: %s", exc)
