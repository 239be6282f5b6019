"""Small ASGI helpers shared by the middlewares."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ._types import ASGIApp, Message, Receive, Scope, Send
from .errors import StoreError
from .pool import KeyPool

logger = logging.getLogger("porch")


def adding_headers(send: Send, headers: Iterable[tuple[bytes, bytes]]) -> Send:
    """Wrap ``send`` to append ``headers`` at ``http.response.start``."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), *headers]
        await send(message)

    return wrapped


def lifespan_send(send: Send, pool: KeyPool) -> Send:
    """Open the pool once the app has started; close it before the app reports shutdown."""

    async def wrapped(message: Message) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            try:
                await pool.start()
            except (StoreError, OSError) as exc:
                # Serve anyway: protected requests answer 503 (fail closed) and the
                # store is retried, instead of a server that will not start at all.
                logger.error("porch: cannot open the store, answering 503 until it opens: %s", exc)
        elif kind == "lifespan.shutdown.complete":
            await pool.close()
        await send(message)

    return wrapped


async def pass_through(
    app: ASGIApp, pool: KeyPool, scope: Scope, receive: Receive, send: Send
) -> None:
    """A non-http scope goes straight to the app; lifespan also opens and closes the pool."""
    if scope["type"] == "lifespan":
        await app(scope, receive, lifespan_send(send, pool))
    else:
        await app(scope, receive, send)
