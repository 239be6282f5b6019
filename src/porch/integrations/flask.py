"""porch as a Flask extension: configured from ``app.config``, installed by ``init_app``::

    from flask import Flask
    from porch import IdempotencyRule, Rule
    from porch.integrations.flask import Porch

    porch = Porch()

    def create_app():
        app = Flask(__name__)
        app.config.update(
            PORCH_STORE="sqlite:///var/lib/app/porch.sqlite3",
            PORCH_RULES=[Rule("60/minute")],
            PORCH_IDEMPOTENCY=[IdempotencyRule("/orders")],
        )
        porch.init_app(app)
        return app

The configuration keys are listed in :mod:`porch.integrations._config` (and the Flask
guide). ``init_app`` puts the middlewares in front of ``app.wsgi_app`` through
:class:`~porch.integrations.wsgi.WSGIMiddleware`: the pool opens at the first request
(in each worker process, after any fork) and closes at the process's exit, or at
:meth:`Porch.close`. One extension object serves any number of apps (an app factory,
tests): each app's pool and middleware are kept in ``app.extensions["porch"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..pool._pool import KeyPool
from ._config import Settings
from .wsgi import WSGIMiddleware

try:
    from flask import Flask
except ImportError as exc:  # pragma: no cover - exercised without flask installed
    raise ImportError("porch.integrations.flask needs Flask: pip install 'porch[flask]'") from exc

__all__ = ["Porch", "PorchState"]

EXTENSION = "porch"


@dataclass(frozen=True, slots=True)
class PorchState:
    """What :meth:`Porch.init_app` installed on one app (``app.extensions["porch"]``)."""

    #: The settings read from ``app.config``.
    settings: Settings
    #: The app's key pool (None when ``PORCH_ENABLED`` is False).
    pool: KeyPool | None
    #: The WSGI middleware in front of the app (None when switched off).
    middleware: WSGIMiddleware | None


class Porch:
    """The Flask extension: ``Porch(app)``, or ``Porch()`` then ``init_app(app)``."""

    def __init__(self, app: Flask | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> PorchState:
        """Read porch's settings from ``app.config`` and put its middlewares in front of the
        app. A wrong setting is a ConfigurationError now, naming the key."""
        if not isinstance(app, Flask):
            raise ConfigurationError(f"init_app needs a Flask app, got {app!r}")
        if EXTENSION in app.extensions:
            raise ConfigurationError(f"porch is already installed on the Flask app {app.name!r}")
        settings = Settings.read(app.config, default_dir=Path(app.instance_path) / "porch-data")
        pool: KeyPool | None = None
        middleware: WSGIMiddleware | None = None
        if settings.enabled:
            pool = settings.open_pool()
            middleware = WSGIMiddleware(app.wsgi_app, pool=pool, wrap=settings.wrap(pool))
            app.wsgi_app = middleware  # type: ignore[method-assign]
        state = PorchState(settings, pool, middleware)
        app.extensions[EXTENSION] = state
        return state

    @staticmethod
    def state(app: Flask) -> PorchState:
        """What ``init_app`` installed on ``app``; ConfigurationError if it was not."""
        state: Any = app.extensions.get(EXTENSION)
        if not isinstance(state, PorchState):
            raise ConfigurationError(f"porch is not installed on the Flask app {app.name!r}")
        return state

    def close(self, app: Flask) -> None:
        """Close ``app``'s pool and stop its event loop now (else done at the process's exit)."""
        middleware = self.state(app).middleware
        if middleware is not None:
            middleware.close()
