"""One WSGI request between the server's thread and the event loop.

The WSGI app runs on the server's own thread, never on the loop: the ASGI
side (the middlewares, then :func:`wsgi_app`) asks that thread for what it
needs — a chunk of the request body, the app's response head, its next body
chunk — and hands back what the client gets, one message at a time, through
the exchange's inbox. The thread serves those asks until the response ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import queue
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from ..._futures import resolve
from ..._types import ASGIApp, Message, Receive, Scope, Send
from ...ratelimit._costs import RESERVATIONS
from ._environ import scope_of, status_line

__all__ = ["Exchange", "StartResponse", "WSGIApp", "wsgi_app"]

StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_CHUNK = 64 * 1024


async def wsgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The WSGI app as the middlewares see it: asks the server's thread to run it."""
    exchange: Exchange = scope["porch.integrations.wsgi"]
    body = await exchange.body_if_read(receive)
    # The rate limiter's reservations go into the environ: the app settles them there.
    status, headers = await exchange.ask("run", body, scope.get(RESERVATIONS))
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


class Exchange:
    """One request: the server's thread serves the loop's requests until the response ends.

    ``asgi`` is the middleware stack around :func:`wsgi_app`; ``app`` the WSGI app.
    """

    __slots__ = (
        "app",
        "asgi",
        "consumed",
        "environ",
        "inbox",
        "iterable",
        "iterator",
        "loop",
        "remaining",
        "start_response",
    )

    def __init__(
        self,
        app: WSGIApp,
        asgi: ASGIApp,
        environ: dict[str, Any],
        start_response: StartResponse,
    ) -> None:
        self.app = app
        self.asgi = asgi
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
        if message.get("more_body", False):
            # Not the last: wait until the server's thread took it on to the client, so a
            # replay read from the store part by part never piles up here faster than
            # the client reads it. (The last one, and a head, need no wait: the thread
            # takes them before it learns that the response ended.)
            reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.inbox.put(("send", reply, message))
            await reply
            return
        self.inbox.put(("send", None, message))

    async def serve(self, scope: Scope) -> None:
        await self.asgi(scope, self.receive(), self.send)

    # -- the server's thread ------------------------------------------------------------

    def run(self, loop: asyncio.AbstractEventLoop) -> Iterator[bytes]:
        self.loop = loop
        scope = scope_of(self.environ)
        scope["porch.integrations.wsgi"] = self
        future = asyncio.run_coroutine_threadsafe(self.serve(scope), loop)
        future.add_done_callback(lambda f: self.inbox.put(("done", None, f)))
        return self._respond(future)

    def _respond(self, future: concurrent.futures.Future[None]) -> Iterator[bytes]:
        started = False
        ended = False  # the last body chunk came
        try:
            while True:
                what, reply, *args = self.inbox.get()
                if what == "send":
                    message: Message = args[0]
                    if message["type"] == "http.response.body" and not message.get(
                        "more_body", False
                    ):
                        ended = True
                    if message["type"] == "http.response.start":
                        self.start_response(
                            status_line(message["status"]),
                            [
                                (k.decode("latin-1"), v.decode("latin-1"))
                                for k, v in message.get("headers", ())
                            ],
                        )
                        started = True
                    elif message.get("body"):
                        yield message["body"]
                    if reply is not None:
                        self._reply(reply, None, None)
                elif what == "done":
                    exc = future.exception() if not future.cancelled() else None
                    if exc is not None:
                        raise exc
                    if not started:
                        raise RuntimeError("porch: the middlewares ended without a response")
                    if not ended:
                        # Cut short (a replay whose stored body could not be read whole):
                        # the server must not end it as if it were complete.
                        raise RuntimeError("porch: the response was cut short")
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
                result = self._start_app(args[0], args[1])
            else:  # "next"
                result = self._next_chunk()
        except BaseException as exc:
            self._reply(reply, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._reply(reply, result, None)

    def _reply(self, reply: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        """From the app's thread: answer the ASGI side's request on its loop."""
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop stopped: nobody waits
                loop.call_soon_threadsafe(resolve, reply, exc, result)

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

    def _start_app(
        self, body: bytes | None, reservations: list[Any] | None
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        environ = self.environ
        if body is not None:
            # A middleware read the body: the app reads the same bytes.
            environ = {**environ, "wsgi.input": io.BytesIO(body)}
            environ["CONTENT_LENGTH"] = str(len(body))
        if reservations is not None:
            # porch.ratelimit.settle(environ, n) (Flask: request.environ) records into them.
            environ[RESERVATIONS] = reservations
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

        self.iterable = self.app(environ, start_response)
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
