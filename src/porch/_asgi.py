"""Small ASGI helpers shared by the middlewares."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable

from ._types import ASGIApp, Message, Receive, Scope, Send
from .errors import StoreError
from .pool._pool import KeyPool

logger = logging.getLogger("porch")


def route_path(scope: Scope) -> str:
    """The path an app routes on: ``path`` less the ``root_path`` it is mounted at.

    ASGI keeps the whole path in ``path`` and a mount's prefix (Starlette's ``Mount``, a
    server's ``--root-path``, WSGI's ``SCRIPT_NAME``) in ``root_path``, so rules match what
    the app's own routes match, wherever the app is mounted (Starlette's get_route_path).
    """
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        rest = path[len(root) :]
        if not rest:
            return "/"
        if rest[0] == "/":
            return rest
    return path


def adding_headers(send: Send, headers: Iterable[tuple[bytes, bytes]]) -> Send:
    """Wrap ``send`` to append ``headers`` at ``http.response.start``."""

    # Not a coroutine function: it hands back send's own awaitable, so each message
    # costs no extra coroutine (two per response on the limiter's hot path).
    def wrapped(message: Message) -> Awaitable[None]:
        kind = message["type"]
        if kind == "http.response.start" or kind == "websocket.accept":
            message["headers"] = [*message.get("headers", ()), *headers]
        return send(message)

    return wrapped


def websocket_denial(scope: Scope, send: Send) -> Send:
    """For a WebSocket handshake: an HTTP answer (a refusal, a 503) sent before accept becomes
    a denial response where the server has the ``websocket.http.response`` extension, and a
    ``websocket.close`` with code 1008 (policy violation) where it has not."""
    denial = "websocket.http.response" in (scope.get("extensions") or {})

    async def wrapped(message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if denial:
                await send({**message, "type": "websocket.http.response.start"})
            else:
                await send({"type": "websocket.close", "code": 1008})
        elif kind == "http.response.body":
            if denial:
                await send({**message, "type": "websocket.http.response.body"})
        else:
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
        await _lifespan(app, pool, scope, receive, send)
    else:
        await app(scope, receive, send)


async def _lifespan(
    app: ASGIApp, pool: KeyPool, scope: Scope, receive: Receive, send: Send
) -> None:
    """The app's lifespan, with the pool opened at startup and closed at shutdown.

    An app that does not speak lifespan (Django's ASGI handler raises on it) fails before
    it answers anything: porch answers the lifespan itself then, for its pool, as a server
    in ``--lifespan auto`` would have gone on without one — so the pool still closes when
    the server stops, instead of never (a server that re-raises its SIGTERM ends the
    process before any other clean-up could run).
    """
    received: list[Message] = []
    answered = False

    async def recording_receive() -> Message:
        message = await receive()
        received.append(message)
        return message

    opening = lifespan_send(send, pool)

    async def recording_send(message: Message) -> None:
        nonlocal answered
        answered = True
        await opening(message)

    try:
        await app(scope, recording_receive, recording_send)
    except Exception as exc:
        if answered:
            raise
        logger.info(
            "porch: the app does not support the ASGI lifespan (%r); porch opens and closes"
            " its pool with the server's lifespan",
            exc,
        )
        await _own_lifespan(pool, received, receive, send)


async def _own_lifespan(
    pool: KeyPool, received: list[Message], receive: Receive, send: Send
) -> None:
    """Answer the lifespan for an app without one: startup opens the pool, shutdown closes it.
    ``received`` holds what the app took from ``receive`` before it failed."""
    opening = lifespan_send(send, pool)
    while True:
        message = received.pop(0) if received else await receive()
        kind = message["type"]
        if kind == "lifespan.startup":
            await opening({"type": "lifespan.startup.complete"})
        elif kind == "lifespan.shutdown":
            await opening({"type": "lifespan.shutdown.complete"})
            return


def replaying(body: bytes, receive: Receive) -> Receive:
    """Hand the app the body already read, then the real channel (a disconnect, say)."""
    pending = True

    async def wrapped() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
