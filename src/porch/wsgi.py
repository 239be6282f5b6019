"""WSGI apps (Flask, Django) behind porch's middlewares, on one background event loop.

The limiter and idempotency are the ASGI middlewares, unchanged: a WSGI
request becomes an ASGI scope and runs through them on an event loop thread
that this module starts at the first request (in each worker process, after
any fork) and stops at exit, closing the pool first (no task is left pending).
The WSGI app itself runs on the server's own thread, never on the loop: the
ASGI side asks that thread for what it needs — a chunk of the request body,
the app's response head, its next body chunk — and hands back what the client
gets, one message at a time. So a response streams as the app produces it,
the request body is read only if a middleware or the app reads it, and the
idempotency middleware captures the response (status, headers, the body
iterable, whose ``close()`` is always called) exactly as under ASGI.

Counts stay exact across processes (gunicorn's sync workers, say) because
every decision is the shared store's. One :class:`WSGIMiddleware` per pool:
the pool lives on this middleware's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import io
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from types import TracebackType
from typing import Any

from ._types import ASGIApp, Message, Receive, Scope, Send
from .errors import ConfigurationError
from .pool import KeyPool

__all__ = ["WSGIApp", "WSGIMiddleware"]

logger = logging.getLogger("porch.wsgi")

StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_CHUNK = 64 * 1024
# Stopping at exit is bounded: a wedged store must not hold the worker's exit forever.
_STOP_TIMEOUT = 10.0


class _Loop:
    """The background event loop of one process: started at first use, stopped at exit."""

    __slots__ = ("_guard", "_loop", "_pid", "_pool", "_registered", "_thread")

    def __init__(self, pool: KeyPool) -> None:
        self._pool = pool
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._registered = False

    def get(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is not None and self._pid == os.getpid():
            return loop
        with self._guard:
            if self._loop is not None and self._pid == os.getpid():
                return self._loop
            # First use in this process (a forked worker never has its parent's thread).
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=_run, args=(loop, ready), name="porch-wsgi-loop", daemon=True
            )
            thread.start()
            ready.wait()
            self._loop, self._thread, self._pid = loop, thread, os.getpid()
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True
            return loop

    def stop(self) -> None:
        """Close the pool on its loop, then stop the loop and its thread."""
        with self._guard:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._pid != os.getpid():
                return
            self._loop = self._thread = None
        try:
            asyncio.run_coroutine_threadsafe(self._pool.close(), loop).result(_STOP_TIMEOUT)
        except Exception as exc:  # exiting anyway: say so, never a traceback at exit
            logger.error("porch: closing the pool at exit failed: %r", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_STOP_TIMEOUT)


def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
        # Whatever still runs (a request cut short at exit) ends here, not in a warning.
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


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
        self._asgi = wrap(self._inner)
        self._loop = _Loop(pool)

    def close(self) -> None:
        """Close the pool and stop the background loop (also done at exit)."""
        self._loop.stop()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not self.enabled:
            return self.app(environ, start_response)
        return _Exchange(self, environ, start_response).run(self._loop.get())

    async def _inner(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The WSGI app as the middlewares see it: asks the server's thread to run it."""
        exchange: _Exchange = scope["porch.wsgi"]
        body = await exchange.body_if_read(receive)
        status, headers = await exchange.ask("run", body)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        # One chunk ahead: the last one goes out as the end of the response, which the
        # idempotency middleware holds until the stored copy is committed.
        chunk: bytes | None = await exchange.ask("next")
        if chunk is None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        while chunk is not None:
            following: bytes | None = await exchange.ask("next")
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": following is not None}
            )
            chunk = following


class _Exchange:
    """One request: the server's thread serves the loop's requests until the response ends."""

    __slots__ = (
        "app",
        "consumed",
        "environ",
        "inbox",
        "iterable",
        "iterator",
        "loop",
        "middleware",
        "remaining",
        "start_response",
    )

    def __init__(
        self, middleware: WSGIMiddleware, environ: dict[str, Any], start_response: StartResponse
    ) -> None:
        self.middleware = middleware
        self.environ = environ
        self.start_response = start_response
        # Requests from the loop to this thread, and the response going the other way.
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.consumed = False  # a middleware read the body through receive()
        self.remaining: int | None = None  # body bytes left to read (CONTENT_LENGTH)
        self.iterable: Iterable[bytes] | None = None
        self.iterator: Iterator[bytes] | None = None

    # -- the loop's side ---------------------------------------------------------------

    async def ask(self, what: str, *args: Any) -> Any:
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.inbox.put((what, reply, *args))
        return await reply

    async def body_if_read(self, receive: Receive) -> bytes | None:
        """The body a middleware already read (to hand the app), or None (the app reads it)."""
        if not self.consumed:
            return None
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def receive(self) -> Receive:
        done = False

        async def receive() -> Message:
            nonlocal done
            if done:
                # Nothing more comes from a WSGI server: the request is over when the app is.
                await asyncio.Event().wait()
            self.consumed = True
            chunk: bytes = await self.ask("read")
            more = len(chunk) > 0
            if not more:
                done = True
            return {"type": "http.request", "body": chunk, "more_body": more}

        return receive

    async def send(self, message: Message) -> None:
        self.inbox.put(("send", None, message))

    async def serve(self, scope: Scope) -> None:
        await self.middleware._asgi(scope, self.receive(), self.send)

    # -- the server's thread ------------------------------------------------------------

    def run(self, loop: asyncio.AbstractEventLoop) -> Iterator[bytes]:
        self.loop = loop
        scope = _scope(self.environ)
        scope["porch.wsgi"] = self
        future = asyncio.run_coroutine_threadsafe(self.serve(scope), loop)
        future.add_done_callback(lambda f: self.inbox.put(("done", None, f)))
        return self._respond(future)

    def _respond(self, future: concurrent.futures.Future[None]) -> Iterator[bytes]:
        started = False
        try:
            while True:
                what, reply, *args = self.inbox.get()
                if what == "send":
                    message: Message = args[0]
                    if message["type"] == "http.response.start":
                        self.start_response(
                            _status_line(message["status"]),
                            [
                                (k.decode("latin-1"), v.decode("latin-1"))
                                for k, v in message.get("headers", ())
                            ],
                        )
                        started = True
                    elif message.get("body"):
                        yield message["body"]
                elif what == "done":
                    exc = future.exception() if not future.cancelled() else None
                    if exc is not None:
                        raise exc
                    if not started:
                        raise RuntimeError("porch: the middlewares ended without a response")
                    return
                else:
                    self._answer(what, reply, args)
        finally:
            # The client left (the server closed us) or the app raised: stop the ASGI side,
            # whose idempotency owner then releases its key; always close the app's iterable.
            if not future.done():
                future.cancel()
            self._close_app()

    def _answer(self, what: str, reply: asyncio.Future[Any], args: list[Any]) -> None:
        try:
            if what == "read":
                result: Any = self._read()
            elif what == "run":
                result = self._start_app(args[0])
            else:  # "next"
                result = self._next_chunk()
        except BaseException as exc:
            self._settle(reply, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._settle(reply, result, None)

    def _settle(self, reply: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop stopped: nobody waits
                loop.call_soon_threadsafe(_settle, reply, result, exc)

    def _read(self) -> bytes:
        """The next chunk of the request body, never past CONTENT_LENGTH (PEP 3333)."""
        environ = self.environ
        stream = environ["wsgi.input"]
        if environ.get("wsgi.input_terminated"):  # the server ends the stream itself
            return bytes(stream.read(_CHUNK))
        if self.remaining is None:
            try:
                self.remaining = max(int(environ.get("CONTENT_LENGTH") or 0), 0)
            except ValueError:
                self.remaining = 0
        if self.remaining <= 0:
            return b""
        chunk = bytes(stream.read(min(_CHUNK, self.remaining)))
        self.remaining = self.remaining - len(chunk) if chunk else 0
        return chunk

    def _start_app(self, body: bytes | None) -> tuple[int, list[tuple[bytes, bytes]]]:
        environ = self.environ
        if body is not None:
            # A middleware read the body: the app reads the same bytes.
            environ = {**environ, "wsgi.input": io.BytesIO(body)}
            environ["CONTENT_LENGTH"] = str(len(body))
        head: list[Any] = []

        def start_response(
            status: str,
            headers: list[tuple[str, str]],
            exc_info: tuple[type[BaseException], BaseException, TracebackType] | None = None,
        ) -> Callable[[bytes], object]:
            if exc_info is not None and head:
                raise exc_info[1].with_traceback(exc_info[2])
            head[:] = [status, headers]
            return _no_write

        self.iterable = self.middleware.app(environ, start_response)
        self.iterator = iter(self.iterable)
        first = b""
        if not head:
            # start_response may come with the first chunk (a generator app).
            first = next(self.iterator, b"")
            if not head:
                raise RuntimeError("the WSGI app returned without calling start_response")
        if first:
            self.iterator = _prepend(first, self.iterator)
        status = int(str(head[0]).split(" ", 1)[0])
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head[1]]
        return status, headers

    def _next_chunk(self) -> bytes | None:
        iterator = self.iterator
        if iterator is None:
            return None
        for chunk in iterator:
            if chunk:
                return bytes(chunk)
        self._close_app()
        return None

    def _close_app(self) -> None:
        iterable, self.iterable, self.iterator = self.iterable, None, None
        close = getattr(iterable, "close", None)
        if close is not None:
            close()


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _no_write(data: bytes) -> object:
    raise RuntimeError("porch's WSGI middleware does not support the write() callable")


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _scope(environ: dict[str, Any]) -> Scope:
    """The ASGI scope of a WSGI request (PEP 3333 strings are latin-1 bytes)."""
    headers: list[tuple[bytes, bytes]] = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            field = name[5:].replace("_", "-").lower()
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if not value:
                continue
            field = name.replace("_", "-").lower()
        else:
            continue
        headers.append((field.encode("latin-1"), str(value).encode("latin-1")))
    script = environ.get("SCRIPT_NAME", "")
    path = environ.get("PATH_INFO", "") or "/"
    raw = (script + path).encode("latin-1")
    remote = environ.get("REMOTE_ADDR") or ""
    client: tuple[str, int] | None = None
    if remote:
        try:
            client = (remote, int(environ.get("REMOTE_PORT") or 0))
        except ValueError:
            client = (remote, 0)
    protocol = str(environ.get("SERVER_PROTOCOL", "HTTP/1.1"))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": protocol.split("/", 1)[-1] if "/" in protocol else "1.1",
        "method": str(environ.get("REQUEST_METHOD", "GET")).upper(),
        "scheme": environ.get("wsgi.url_scheme", "http"),
        "path": (script + path).encode("latin-1").decode("utf-8", "replace"),
        "raw_path": raw,
        "root_path": "",
        "query_string": str(environ.get("QUERY_STRING", "")).encode("latin-1"),
        "headers": headers,
        "client": client,
        "server": (environ.get("SERVER_NAME", ""), int(environ.get("SERVER_PORT") or 0)),
        "state": {},
        "wsgi.environ": environ,
    }
