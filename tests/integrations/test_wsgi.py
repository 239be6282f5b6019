"""porch.integrations.wsgi under a real WSGI server (wsgiref, on a loopback socket in a thread).

gunicorn with several sync workers is exercised by tests/e2e/test_examples.py
(Flask, Django); these tests pin the bridge itself: bodies both ways, streaming,
``close()``, failures, and a clean stop.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.util import setup_testing_defaults

import httpx
import pytest

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    Quota,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch.integrations.wsgi import WSGIMiddleware
from porch.ratelimit import CostRequest, settle
from porch.store.base import Parts
from porch.store.sqlite.blobs import blob_path


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class App:
    """A WSGI app that streams, records close(), echoes bodies and fails on demand."""

    def __init__(self) -> None:
        self.runs = 0
        self.closed = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        self.runs += 1
        if path == "/fail" and self.runs == 1:
            raise RuntimeError("the first run fails")
        start_response("201 Created", [("Content-Type", "text/plain"), ("X-Run", str(self.runs))])
        return self.Stream([b"run ", str(self.runs).encode(), b" got ", body], self)

    class Stream:
        def __init__(self, chunks: list[bytes], app: App) -> None:
            self.chunks = chunks
            self.app = app

        def __iter__(self) -> Iterator[bytes]:
            yield from self.chunks

        def close(self) -> None:
            self.app.closed += 1


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, App, WSGIMiddleware]]:
    app = App()
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    guarded = WSGIMiddleware(
        app,
        pool=pool,
        wrap=lambda inner: RateLimitMiddleware(
            IdempotencyMiddleware(inner, pool=pool, rules=IdempotencyRule("/", methods=["POST"])),
            pool=pool,
            rules=Rule(Limit(3, 60), path="/limited"),
        ),
    )
    server: WSGIServer = make_server("127.0.0.1", 0, guarded, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", app, guarded
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        guarded.close()


def test_bodies_both_ways_streamed_and_closed(served: tuple[str, App, WSGIMiddleware]) -> None:
    base, app, _ = served
    plain = httpx.post(base + "/echo", content=b"unkeyed", timeout=30)
    assert plain.status_code == 201
    assert plain.content == b"run 1 got unkeyed"
    keyed = httpx.post(base + "/echo", content=b"keyed", headers={"Idempotency-Key": "k1"})
    assert keyed.content == b"run 2 got keyed"
    again = httpx.post(base + "/echo", content=b"keyed", headers={"Idempotency-Key": "k1"})
    assert again.content == keyed.content
    assert again.headers["idempotent-replayed"] == "true"
    assert app.runs == 2
    assert app.closed == 2  # every iterable the app returned was closed


def test_limits_and_their_headers(served: tuple[str, App, WSGIMiddleware]) -> None:
    base, app, _ = served
    answers = [httpx.get(base + "/limited", timeout=30) for _ in range(5)]
    assert [a.status_code for a in answers] == [201, 201, 201, 429, 429]
    assert answers[0].headers["x-ratelimit-remaining"] == "2"
    assert answers[3].headers["content-type"] == "application/problem+json"
    assert int(answers[3].headers["retry-after"]) >= 1
    assert app.runs == 3


def test_a_failing_owner_releases_its_key(served: tuple[str, App, WSGIMiddleware]) -> None:
    base, _app, _ = served
    first = httpx.post(base + "/fail", content=b"x", headers={"Idempotency-Key": "f"}, timeout=30)
    assert first.status_code == 500  # the server's answer to an app that raised
    second = httpx.post(base + "/fail", content=b"x", headers={"Idempotency-Key": "f"}, timeout=30)
    assert second.status_code == 201  # ran again: nothing was stored, the key was free
    assert "idempotent-replayed" not in second.headers


def test_invalid_utf8_paths_are_distinct_requests(
    served: tuple[str, App, WSGIMiddleware],
) -> None:
    # Catches: PATH_INFO decoded with "replace", so /echo/%80 and /echo/%81 shared one
    # digest path and the second was answered with the first's response (issue 26,
    # finding 10). The digest is over the path's raw bytes.
    base, app, _ = served
    key = {"Idempotency-Key": "raw-path"}
    first = httpx.post(base + "/echo/%80", content=b"x", headers=key, timeout=30)
    other = httpx.post(base + "/echo/%81", content=b"x", headers=key, timeout=30)
    again = httpx.post(base + "/echo/%80", content=b"x", headers=key, timeout=30)
    assert first.status_code == 201
    assert other.status_code == 422
    assert again.headers["idempotent-replayed"] == "true"
    assert app.runs == 1


def _record(
    started: list[str], status: str, headers: Any, *exc_info: Any
) -> Callable[[bytes], object]:
    started.append(status)
    return lambda data: None


def test_an_empty_remote_addr_is_refused_not_shared(
    served: tuple[str, App, WSGIMiddleware], caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a WSGI server without REMOTE_ADDR put every anonymous caller in one scope
    # (issue 26, finding 2): the second caller got the first's stored response.
    _, app, guarded = served
    caplog.set_level(logging.WARNING, "porch.idempotency")
    answers = []
    for remote in ("", None):
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        environ.update(
            REQUEST_METHOD="POST",
            PATH_INFO="/echo",
            CONTENT_LENGTH="1",
            HTTP_IDEMPOTENCY_KEY="anon",
        )
        environ["wsgi.input"] = io.BytesIO(b"x")
        if remote is None:
            environ.pop("REMOTE_ADDR", None)
        else:
            environ["REMOTE_ADDR"] = remote
        started: list[str] = []
        body = b"".join(guarded(environ, functools.partial(_record, started)))
        answers.append((started[0], json.loads(body)))
    assert [status for status, _ in answers] == ["503 Service Unavailable"] * 2
    assert {problem["cause"] for _, problem in answers} == {"unidentified"}
    assert app.runs == 0
    assert sum("REMOTE_ADDR" in r.getMessage() for r in caplog.records) == 1


def test_close_stops_the_loop_thread(served: tuple[str, App, WSGIMiddleware]) -> None:
    base, _, guarded = served
    assert httpx.get(base + "/echo", timeout=30).status_code == 201
    assert any(t.name == "porch-wsgi-loop" for t in threading.enumerate())
    guarded.close()
    assert not any(t.name == "porch-wsgi-loop" for t in threading.enumerate())
    assert not guarded.pool.started
    # The next request starts it again.
    assert httpx.get(base + "/echo", timeout=30).status_code == 201


def test_off_switch_and_configuration(tmp_path: Path) -> None:
    app = App()
    pool = KeyPool(SQLiteStore(tmp_path))
    off = WSGIMiddleware(app, pool=pool, wrap=lambda inner: inner, enabled=False)
    assert off.app is app
    with pytest.raises(ConfigurationError, match="pool must be a porch KeyPool"):
        WSGIMiddleware(app, pool=object(), wrap=lambda inner: inner)  # type: ignore[arg-type]


def test_rules_match_the_path_below_script_name(tmp_path: Path) -> None:
    """A WSGI app mounted at SCRIPT_NAME sees PATH_INFO: rules match that, as routes do."""
    app = App()
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    guarded = WSGIMiddleware(
        app,
        pool=pool,
        wrap=lambda inner: RateLimitMiddleware(
            inner, pool=pool, rules=Rule(Limit(2, 60), path="/limited")
        ),
    )

    def mounted(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        environ["SCRIPT_NAME"] = "/shop"
        environ["PATH_INFO"] = environ["PATH_INFO"].removeprefix("/shop")
        return guarded(environ, start_response)

    server: WSGIServer = make_server("127.0.0.1", 0, mounted, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/shop"
        statuses = [httpx.get(base + "/limited", timeout=30).status_code for _ in range(3)]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        guarded.close()
    assert statuses == [201, 201, 429]


class VanishingParts:
    """The store's real PartStore; while ``vanish`` is set, reading part 0 deletes part 2
    from the side file (a real connection): a replay then loses it after its head left."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        inner = store.capabilities.parts  # the side file's parts
        assert inner is not None
        self.inner = inner
        self.part_bytes = self.inner.part_bytes
        self.vanish = False

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        await self.inner.write(key, body, index, data)

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        await self.inner.keep(key, parts, ttl)

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        if index == 0 and self.vanish:
            with sqlite3.connect(blob_path(self.store.path)) as conn:
                conn.execute("DELETE FROM parts WHERE seq = 2")
        return await self.inner.read(key, parts, index)

    def drop(self, key: str, body: int) -> None:
        self.inner.drop(key, body)


def test_a_big_response_streams_through_the_bridge_both_ways(tmp_path: Path) -> None:
    size = 3 * (1 << 20) + 12345
    runs: list[int] = []

    def export(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        runs.append(1)
        start_response("201 Created", [("Content-Type", "application/octet-stream")])
        pattern = bytes(range(256)) * 256
        return (pattern[: min(len(pattern), size - i)] for i in range(0, size, len(pattern)))

    store = SQLiteStore(tmp_path)
    vanishing = VanishingParts(store)
    store.capabilities = replace(store.capabilities, parts=vanishing)
    pool = KeyPool(store, size=2)
    quota = Quota(scope_bytes=32 << 20, client_bytes=32 << 20, total_bytes=1 << 30)
    guarded = WSGIMiddleware(
        export,
        pool=pool,
        wrap=lambda inner: IdempotencyMiddleware(
            inner, pool=pool, rules=IdempotencyRule("/", methods=["POST"]),
            max_stored=8 << 20, quota=quota,
        ),
    )  # fmt: skip

    def post() -> tuple[list[tuple[str, list[tuple[str, str]]]], Iterable[bytes]]:
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        environ.update(REQUEST_METHOD="POST", PATH_INFO="/export", HTTP_IDEMPOTENCY_KEY="big")
        environ["REMOTE_ADDR"] = "10.0.0.1"
        heads: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: Any) -> Callable[[bytes], object]:
            heads.append((status, headers))
            return lambda data: None

        return heads, guarded(environ, start_response)

    try:
        _, body = post()
        first = b"".join(body)
        assert len(first) == size
        heads, body = post()
        assert b"".join(body) == first
        assert ("idempotent-replayed", "true") in heads[0][1]
        # A part gone after the head left: the response ends short, never as if complete
        # (the iterable raises: a server with keep-alive would otherwise end it as whole).
        vanishing.vanish = True
        heads, body = post()
        with pytest.raises(RuntimeError, match="cut short"):
            b"".join(body)
        assert heads[0][0] == "201 Created"
    finally:
        guarded.close()
    assert len(runs) == 1


def test_a_wsgi_app_settles_its_reservation_in_the_environ(tmp_path: Path) -> None:
    """A token budget under the bridge: the app reports what it used with settle(environ)."""

    def completions(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = json.loads(environ["wsgi.input"].read(length))
        used = min(body["max_tokens"], len(body["prompt"].split()))
        assert settle(environ, used)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"tokens": used}).encode()]

    async def max_tokens(request: CostRequest) -> int:
        return int((await request.json())["max_tokens"])

    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    guarded = WSGIMiddleware(
        completions,
        pool=pool,
        wrap=lambda inner: RateLimitMiddleware(
            inner,
            pool=pool,
            rules=Rule(Limit(100, 60, name="tokens"), cost=max_tokens, settle=True),
        ),
    )
    server: WSGIServer = make_server("127.0.0.1", 0, guarded, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        first = httpx.post(base, json={"prompt": "a b c", "max_tokens": 90}, timeout=30)
        second = httpx.post(base, json={"prompt": "d", "max_tokens": 97}, timeout=30)
        third = httpx.post(base, json={"prompt": "e", "max_tokens": 97}, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        guarded.close()
    assert (first.status_code, first.json()) == (200, {"tokens": 3})
    assert (second.status_code, second.json()) == (200, {"tokens": 1})  # 3 + 97 <= 100
    assert third.status_code == 429  # 3 + 1 + 97 > 100


def test_a_loop_thread_that_cannot_start_is_a_503_not_a_blocked_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The loop thread held before it runs (a worker starved of CPU): the request waits at
    # most the start deadline, then gets a 503; once the thread can run, the next works.
    from porch.integrations.wsgi import _loop

    held = threading.Event()
    real = _loop._run

    def starved(loop: Any, ready: threading.Event) -> None:
        held.wait(30)
        real(loop, ready)

    monkeypatch.setattr(_loop, "_START_TIMEOUT", 0.2)
    monkeypatch.setattr(_loop, "_run", starved)
    app = App()
    pool = KeyPool(SQLiteStore(tmp_path))
    guarded = WSGIMiddleware(app, pool=pool, wrap=lambda inner: inner)

    def call() -> tuple[str, bytes]:
        environ: dict[str, Any] = {"PATH_INFO": "/echo", "REQUEST_METHOD": "GET"}
        setup_testing_defaults(environ)
        status: list[str] = []
        body = b"".join(guarded(environ, functools.partial(_record, status)))
        return status[0], body

    status, body = call()
    assert status == "503 Service Unavailable"
    assert json.loads(body)["detail"] == "porch's event loop thread did not start within 0.2 s"
    assert "did not start within 0.2 s; answering 503" in caplog.text
    assert app.runs == 0
    held.set()  # the starved thread runs now, sees its stop, and ends
    monkeypatch.setattr(_loop, "_run", real)
    try:
        status, _ = call()
        assert status.startswith("201")
        assert app.runs == 1
    finally:
        guarded.close()
