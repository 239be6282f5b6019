"""porch's settings read from a framework's configuration mapping (Flask's and Quart's
``app.config``): the store, the pool, and the two middlewares, validated once.

The keys (``PORCH_ENABLED``, ``PORCH_STORE``, ``PORCH_DATA_DIR``, ``PORCH_POOL``,
``PORCH_RULES``, ``PORCH_RATELIMIT``, ``PORCH_IDEMPOTENCY``, ``PORCH_IDEMPOTENCY_OPTIONS``)
are described in the Flask guide (docs/frameworks/flask.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .._types import ASGIApp
from ..errors import ConfigurationError
from ..idempotency._middleware import IdempotencyMiddleware, IdempotencyRule
from ..pool._pool import KeyPool
from ..ratelimit._middleware import RateLimitMiddleware
from ..ratelimit._rules import Rule
from ..store.base import Capabilities, Store

__all__ = ["KEYS", "Settings"]

T = TypeVar("T")

KEYS = frozenset(
    {
        "PORCH_ENABLED",
        "PORCH_STORE",
        "PORCH_DATA_DIR",
        "PORCH_POOL",
        "PORCH_RULES",
        "PORCH_RATELIMIT",
        "PORCH_IDEMPOTENCY",
        "PORCH_IDEMPOTENCY_OPTIONS",
    }
)


@dataclass(frozen=True, slots=True)
class Settings:
    """porch's settings from a configuration mapping (see the module's table)."""

    enabled: bool = True
    store: str | Store | None = None
    data_dir: Path | None = None
    pool: Mapping[str, Any] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    ratelimit: Mapping[str, Any] = field(default_factory=dict)
    idempotency: tuple[IdempotencyRule, ...] = ()
    idempotency_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, config: Mapping[str, Any], *, default_dir: Path) -> Settings:
        """The settings in ``config``; ConfigurationError naming the key that is wrong."""
        unknown = sorted(k for k in config if k.startswith("PORCH_") and k not in KEYS)
        if unknown:
            raise ConfigurationError(
                f"unknown porch setting {unknown[0]!r}; porch reads {', '.join(sorted(KEYS))}"
            )
        enabled = config.get("PORCH_ENABLED", True)
        if not isinstance(enabled, bool):
            raise ConfigurationError(f"PORCH_ENABLED must be True or False, got {enabled!r}")
        store = config.get("PORCH_STORE")
        # A Store is a protocol: known by the Capabilities every store declares.
        is_store = isinstance(getattr(store, "capabilities", None), Capabilities)
        if store is not None and not isinstance(store, str) and not is_store:
            raise ConfigurationError(
                f"PORCH_STORE must be a store URL or a porch Store, got {store!r}"
            )
        data_dir = config.get("PORCH_DATA_DIR")
        if data_dir is not None and not isinstance(data_dir, str | Path):
            raise ConfigurationError(f"PORCH_DATA_DIR must be a path, got {data_dir!r}")
        rules = _listed(config, "PORCH_RULES", Rule)
        idempotency = _listed(config, "PORCH_IDEMPOTENCY", IdempotencyRule)
        return cls(
            enabled=enabled,
            store=store,
            data_dir=Path(data_dir) if data_dir is not None else default_dir,
            pool=_options(config, "PORCH_POOL"),
            rules=rules,
            ratelimit=_options(config, "PORCH_RATELIMIT"),
            idempotency=idempotency,
            idempotency_options=_options(config, "PORCH_IDEMPOTENCY_OPTIONS"),
        )

    def open_pool(self) -> KeyPool:
        """The key pool over the configured store (not opened yet: the integration opens it)."""
        from ..store import SQLiteStore, open_store

        store = self.store
        if isinstance(store, str):
            store = open_store(store)
        elif store is None:
            store = SQLiteStore(self.data_dir or Path("porch-data"))
        try:
            return KeyPool(store, **self.pool)
        except TypeError as exc:
            raise ConfigurationError(f"PORCH_POOL: {exc}") from exc

    def wrap(self, pool: KeyPool) -> Callable[[ASGIApp], ASGIApp]:
        """A function putting the configured middlewares around an ASGI app: the limiter
        outside, idempotency inside. Every middleware is built (and so validated) now."""

        def around(app: ASGIApp) -> ASGIApp:
            if self.idempotency:
                try:
                    app = IdempotencyMiddleware(
                        app, pool=pool, rules=self.idempotency, **self.idempotency_options
                    )
                except TypeError as exc:
                    raise ConfigurationError(f"PORCH_IDEMPOTENCY_OPTIONS: {exc}") from exc
            if self.rules:
                try:
                    app = RateLimitMiddleware(app, pool=pool, rules=self.rules, **self.ratelimit)
                except TypeError as exc:
                    raise ConfigurationError(f"PORCH_RATELIMIT: {exc}") from exc
            return app

        around(_unused)
        return around


async def _unused(scope: Any, receive: Any, send: Any) -> None:
    """The app the middlewares are first built around, only to validate them."""


def _listed(config: Mapping[str, Any], name: str, kind: type[T]) -> tuple[T, ...]:
    value = config.get(name)
    if value is None:
        return ()
    items = (value,) if isinstance(value, kind) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, kind) for i in items):
        raise ConfigurationError(
            f"{name} must be a {kind.__name__} or a list of them, got {value!r}"
        )
    return tuple(items)


def _options(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"{name} must be a dict of keyword arguments, got {value!r}")
    return dict(value)
