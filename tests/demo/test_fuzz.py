"""Hypothesis fuzzing of the demo's whole middleware stack, in process, over raw ASGI.

Methods, paths, query strings, headers (the forwarding, idempotency, length and
credential headers included) and bodies (whole or in chunks) are generated within
what an HTTP server can hand an ASGI app; every request must be answered, with
anything but a 5xx — except a deliberate 503 that names its cause.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from porch.demo import DemoConfig, create_app

TOKEN = st.text(
    alphabet="!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    min_size=1,
    max_size=12,
)
METHODS = st.one_of(
    st.just("POST"),
    st.just("GET"),
    st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
    TOKEN,
)
PATHS = st.one_of(
    st.just("/orders"),
    st.just("/orders"),
    st.sampled_from(["/orders", "/products", "/health", "/metrics", "/", "/orders/", "//orders"]),
    st.builds(lambda s: "/" + s, st.text(max_size=40)),
)
# Header values an HTTP/1.1 parser lets through: no CR, LF or NUL.
VALUES = st.binary(max_size=60).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"")
)
NAMED = st.sampled_from(
    [
        b"idempotency-key",
        b"x-forwarded-for",
        b"forwarded",
        b"content-type",
        b"authorization",
        b"cookie",
        b"content-length",
        b"transfer-encoding",
        b"host",
    ]
)
LIKELY = st.one_of(
    st.tuples(
        st.just(b"idempotency-key"), st.text(alphabet="abc-_:0123", max_size=8).map(str.encode)
    ),
    st.tuples(st.just(b"x-forwarded-for"), st.ip_addresses().map(lambda ip: str(ip).encode())),
    st.tuples(st.just(b"content-type"), st.just(b"application/json")),
)
HEADERS = st.lists(
    st.one_of(LIKELY, st.tuples(st.one_of(NAMED, TOKEN.map(lambda t: t.lower().encode())), VALUES)),
    max_size=8,
)
ORDERISH = st.one_of(
    st.fixed_dictionaries(
        {"item": st.text(max_size=30), "qty": st.one_of(st.integers(-5, 20_000), st.integers())}
    ).map(lambda doc: json.dumps(doc).encode()),
    st.binary(max_size=300),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["item", "qty", "x"]), inner, max_size=3),
        ),
        max_leaves=10,
    ).map(lambda doc: json.dumps(doc).encode()),
)


class Harness:
    """One demo app on one event loop, driven request by request."""

    def __init__(self, data: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.app = create_app(
            DemoConfig(data_dir=str(data), limit=1_000_000, window=3600, trust_proxy_hops=1)
        )

    def request(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        chunks: list[bytes],
    ) -> tuple[int, bytes]:
        return self.loop.run_until_complete(self._request(method, path, query, headers, chunks))

    async def _request(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        chunks: list[bytes],
    ) -> tuple[int, bytes]:
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("utf-8", "surrogateescape"),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": ("10.9.8.7", 4321),
            "server": ("127.0.0.1", 8000),
        }
        pending = list(chunks) or [b""]

        async def receive() -> dict[str, Any]:
            if pending:
                chunk = pending.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
            await asyncio.sleep(3600)  # a client that stays connected
            return {"type": "http.disconnect"}

        status = 0
        body = b""

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                assert status == 0, "two response starts"
                status = message["status"]
            elif message["type"] == "http.response.body":
                body += message.get("body", b"")

        await asyncio.wait_for(self.app(scope, receive, send), timeout=30)
        return status, body

    def close(self) -> None:
        self.loop.run_until_complete(self.app.state.pool.close())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.close()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=METHODS,
    path=PATHS,
    query=st.binary(max_size=40),
    headers=HEADERS,
    body=ORDERISH,
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=3),
)
def test_the_stack_never_answers_5xx(
    harness: Harness,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    cuts: list[int],
) -> None:
    points = sorted({min(c, len(body)) for c in cuts})
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    status, content = harness.request(method, path, query, headers, chunks)
    assert 100 <= status < 600, status
    if status >= 500:
        assert status == 503, (status, content)
        assert json.loads(content)["cause"] in ("saturated", "store"), content
