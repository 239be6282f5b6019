"""porch as a Quart extension: configured from ``app.config``, installed by ``init_app``::

    from quart import Quart
    from porch import IdempotencyRule, Rule
    from porch.integrations.quart import Porch

    porch = Porch()

    def create_app():
        app = Quart(__name__)
        app.config.update(PORCH_RULES=[Rule("60/minute")],
                          PORCH_IDEMPOTENCY=[IdempotencyRule("/orders")])
        porch.init_app(app)
        return app

The configuration keys are Flask's (:mod:`porch.integrations.flask`). ``init_app`` wraps
``app.asgi_app`` with the middlewares, and opens the pool before the app serves
(``before_serving``) and closes it after (``after_serving``), so it follows the app's
lifespan under any ASGI server; each app's pool is kept in ``app.extensions["porch"]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, StoreError
from ..pool._pool import KeyPool
from ._config import Settings

try:
    from quart import Quart
except ImportError as exc:  # pragma: no cover - exercised without quart installed
    raise ImportError("porch.integrations.quart needs Quart: pip install 'porch[quart]'") from exc

__all__ = ["Porch", "PorchState"]

logger = logging.getLogger("porch")
EXTENSION = "porch"


@dataclass(frozen=True, slots=True)
class PorchState:
    """What :meth:`Porch.init_app` installed on one app (``app.extensions["porch"]``)."""

    #: The settings read from ``app.config``.
    settings: Settings
    #: The app's key pool (None when ``PORCH_ENABLED`` is False).
    pool: KeyPool | None


class Porch:
    """The Quart extension: ``Porch(app)``, or ``Porch()`` then ``init_app(app)``."""

    def __init__(self, app: Quart | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Quart) -> PorchState:
        """Read porch's settings from ``app.config``, wrap ``app.asgi_app`` with its
        middlewares and tie the pool to the app's serving. A wrong setting is a
        ConfigurationError now, naming the key."""
        if not isinstance(app, Quart):
            raise ConfigurationError(f"init_app needs a Quart app, got {app!r}")
        if EXTENSION in app.extensions:
            raise ConfigurationError(f"porch is already installed on the Quart app {app.name!r}")
        settings = Settings.read(app.config, default_dir=Path(app.instance_path) / "porch-data")
        pool: KeyPool | None = None
        if settings.enabled:
            pool = settings.open_pool()
            # Quart types its ASGI callables precisely; porch's are the generic ASGI types.
            inner: Any = app.asgi_app
            outer: Any = settings.wrap(pool)(inner)
            app.asgi_app = outer  # type: ignore[method-assign]
            app.before_serving(_opening(pool))
            app.after_serving(pool.close)
        state = PorchState(settings, pool)
        app.extensions[EXTENSION] = state
        return state

    @staticmethod
    def state(app: Quart) -> PorchState:
        """What ``init_app`` installed on ``app``; ConfigurationError if it was not."""
        state: Any = app.extensions.get(EXTENSION)
        if not isinstance(state, PorchState):
            raise ConfigurationError(f"porch is not installed on the Quart app {app.name!r}")
        return state


def _opening(pool: KeyPool) -> Any:
    async def open_pool() -> None:
        try:
            await pool.start()
        except (StoreError, OSError) as exc:
            # As the middlewares do: serve, and answer 503 until the store opens.
            logger.error("porch: cannot open the store, answering 503 until it opens: %s", exc)

    return open_pool
