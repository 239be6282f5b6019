"""Durable stores: the seam, its backends, and opening one from a URL."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigurationError
from .base import (
    Claim,
    Claims,
    Durability,
    Hit,
    Lookup,
    Parts,
    PartStore,
    Quota,
    Release,
    Save,
    SaveOutcome,
    Store,
    StoredResponse,
    StoreOp,
    StoreStatistics,
    Vacate,
)
from .sharded import ShardedStore
from .sqlite import SQLiteStore
from .urls import redact

__all__ = [
    "SCHEMES",
    "Claim",
    "Claims",
    "Durability",
    "Hit",
    "Lookup",
    "PartStore",
    "Parts",
    "Quota",
    "Release",
    "SQLiteStore",
    "Save",
    "SaveOutcome",
    "ShardedStore",
    "Store",
    "StoreOp",
    "StoreStatistics",
    "StoredResponse",
    "Vacate",
    "open_store",
]

SCHEMES = (
    "sqlite",
    "postgresql",
    "postgres",
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
)
"""The URL schemes :func:`open_store` knows."""


def open_store(url: str | Sequence[str], **options: Any) -> Store:
    """The store a URL names (not opened yet: the pool opens it); ``options`` go to its class.

    - ``sqlite:///abs/path/file.sqlite3`` or ``sqlite:relative/file.sqlite3``:
      :class:`SQLiteStore` in that file's directory.
    - ``postgresql://…`` / ``postgres://…``: the PostgreSQL store (``porch[postgres]``).
    - ``redis://…`` / ``rediss://…`` / ``unix://…``: the Redis store (``porch[redis]``).
    - ``redis+cluster://host:port[,host:port…]`` / ``rediss+cluster://…``: the Redis
      Cluster store (``porch[redis-cluster]``).
    - several URLs (a list; one per server, PostgreSQL or Redis, all of one kind): a
      :class:`ShardedStore` over the store each names, each with ``options``;
      ``previous=[...]``, some of those URLs: the servers there before others were added
      (see ``ShardedStore``'s ``previous``).

    Raises ConfigurationError for an unknown scheme, a malformed URL or a missing driver.
    """
    previous = list(options.pop("previous", None) or ())
    if not isinstance(url, str) and isinstance(url, Sequence):
        urls = list(url)
        if not urls:
            raise ConfigurationError("open_store needs a store URL, got an empty list")
        if len(urls) == 1 and not previous:
            return open_store(urls[0], **options)
        schemes = {str(u).split(":", 1)[0].lower() for u in urls}
        if len(schemes & {"postgresql", "postgres"}) != len(schemes) and len(
            schemes & {"redis", "rediss", "unix"}
        ) != len(schemes):
            shown = ", ".join(redact(str(u)) for u in urls)
            raise ConfigurationError(
                "several store URLs must all be PostgreSQL or all Redis (one per server),"
                f" got {shown}"
            )
        unknown = [redact(str(u)) for u in previous if u not in urls]
        if unknown:
            raise ConfigurationError(
                f"previous names stores that are not among the URLs: {', '.join(unknown)}"
            )
        stores = [open_store(u, **options) for u in urls]
        return ShardedStore(stores, previous=[stores[urls.index(u)] for u in previous])
    if previous:
        raise ConfigurationError("previous is for several store URLs (a sharded store)")
    if not isinstance(url, str) or ":" not in url:
        raise ConfigurationError(
            f"a store URL needs a scheme ({', '.join(s + ':' for s in SCHEMES)}),"
            f" got {redact(str(url))!r}"
        )
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        return _sqlite(url, options)
    if scheme in ("postgresql", "postgres"):
        try:
            from .postgres import PostgresStore
        except ImportError as exc:
            raise ConfigurationError(
                f"the PostgreSQL store needs its driver: pip install 'porch[postgres]' ({exc})"
            ) from exc
        return cast_store(PostgresStore(url, **options))
    if scheme in ("redis", "rediss", "unix"):
        try:
            from .redis import RedisStore
        except ImportError as exc:
            raise ConfigurationError(
                f"the Redis store needs its driver: pip install 'porch[redis]' ({exc})"
            ) from exc
        return cast_store(RedisStore(url, **options))
    if scheme in ("redis+cluster", "rediss+cluster"):
        try:
            from .redis import RedisClusterStore
        except ImportError as exc:
            raise ConfigurationError(
                "the Redis Cluster store needs its driver:"
                f" pip install 'porch[redis-cluster]' ({exc})"
            ) from exc
        return cast_store(RedisClusterStore(url, **options))
    raise ConfigurationError(
        f"unknown store URL scheme {scheme!r} in {redact(url)!r}; known: {', '.join(SCHEMES)}"
    )


def cast_store(store: Any) -> Store:
    # The backends are typed; this keeps mypy quiet while a backend package is absent.
    result: Store = store
    return result


def _sqlite(url: str, options: dict[str, Any]) -> SQLiteStore:
    parts = urlsplit(url)
    if parts.netloc or parts.query or parts.fragment:
        raise ConfigurationError(
            "a SQLite store URL is sqlite:///absolute/path/file.sqlite3 or"
            f" sqlite:relative/path/file.sqlite3 (no host, query or fragment), got {redact(url)!r}"
        )
    path = unquote(parts.path)
    if url.lower().startswith("sqlite:///"):
        path = "/" + path.lstrip("/")
    if not path or path.endswith("/"):
        raise ConfigurationError(f"a SQLite store URL must name a file, got {redact(url)!r}")
    file = Path(path)
    if "directory" in options or "filename" in options:
        raise ConfigurationError("the SQLite store URL names the file: pass no directory/filename")
    return SQLiteStore(directory=file.parent, filename=file.name, **options)
