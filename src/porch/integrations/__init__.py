"""porch in each framework: per-route limits and idempotency, and the WSGI bridge.

- :mod:`porch.integrations.starlette`: decorators on endpoints, ``install(app, pool)``.
- :mod:`porch.integrations.fastapi`: the same as FastAPI dependencies.
- :mod:`porch.integrations.wsgi`: the ASGI middlewares in front of a WSGI app (Flask, Django).
- :mod:`porch.integrations.litestar`: a Litestar plugin (middlewares, the pool's lifecycle).
- :mod:`porch.integrations.quart`, :mod:`porch.integrations.flask`: extension objects
  (``init_app``), configured from ``app.config``.

Each imports its framework lazily; the app-level middlewares need none of them.
"""

__all__: list[str] = []
