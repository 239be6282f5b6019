"""The storefront demo: a small shop API protected by porch.

``porch demo`` serves it with uvicorn. The app is built by :func:`create_app`
(:mod:`porch.demo.app`) from a :class:`DemoConfig` (:mod:`porch.demo.config`);
worker processes rebuild it from the config that the CLI passes in the
environment. Counters and stored responses live in ``<data-dir>/porch.sqlite3``
by default, or in the store ``--store URL`` names (shared by several demo
processes: several hosts); the shop's own orders are always this host's, in
``<data-dir>/orders.sqlite3`` (:mod:`porch.demo.orders`). Its input checks are
:mod:`porch.demo.checks`.
"""

from __future__ import annotations

from .app import create_app, create_app_from_env
from .config import DemoConfig

__all__ = ["DemoConfig", "create_app", "create_app_from_env"]
