"""The demo's own input validation, against a real ``porch demo`` process.

Hostile bodies (deep nesting, integers SQLite cannot hold, lone surrogates,
wrong types) are a 400/422 problem, never a 500; every body is capped (a 30 MB
order is refused 413, declared or streamed); ``GET /orders`` is paginated while
``count`` stays the host's total. Counts come from the orders table's rows.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, launch_demos, order_rows, read_response

from support import HOSTILE_BODIES

pytestmark = [pytest.mark.e2e]

BIG = 30 << 20


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def test_hostile_bodies_are_refused_never_500(demo: DemoLauncher) -> None:
    server = demo.start(limit=10_000, window=60)
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        for n, (body, status) in enumerate(HOSTILE_BODIES):
            for headers in ({}, {"Idempotency-Key": f"hostile-{n}"}):
                response = http.post("/orders", content=body, headers=headers)
                assert response.status_code == status, (body[:40], headers, response.text)
                assert response.headers["content-type"] == "application/problem+json"
        assert http.get("/health").status_code == 200
    assert order_rows(server) == []
    assert "Traceback" not in server.stderr(), server.output()


def test_a_30_mb_order_is_refused_unread(demo: DemoLauncher) -> None:
    server = demo.start(limit=10_000, window=60)
    big = b'{"item": "' + b"x" * BIG + b'", "qty": 1}'

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    with httpx.Client(base_url=server.base_url, timeout=60.0, trust_env=False) as http:
        for headers in ({}, {"Idempotency-Key": "big"}):
            # Declared: refused from the Content-Length, before a byte of body is read.
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                head = (
                    "POST /orders HTTP/1.1\r\nHost: demo\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(big)}\r\n"
                    + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                    + "\r\n"
                )
                sock.sendall(head.encode("ascii"))
                status, _, content = read_response(sock)
                assert status == 413, content
            # Streamed (chunked, no length): refused once the reader passes the cap.
            try:
                response = http.post("/orders", content=chunks(), headers=headers)
            except httpx.WriteError:
                pass  # the server answered and closed while we were still sending
            else:
                assert response.status_code == 413, response.text
        assert http.get("/orders").json()["count"] == 0
    assert order_rows(server) == []
    assert "Traceback" not in server.stderr(), server.output()


def test_orders_are_paginated_with_the_total_count(demo: DemoLauncher) -> None:
    server = demo.start(limit=10_000, window=60)
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        for i in range(25):
            created = http.post("/orders", json={"item": f"item-{i}", "qty": i + 1})
            assert created.status_code == 201, created.text
        ids: list[int] = []
        after: int | None = 0
        pages = 0
        while after is not None:
            page = http.get("/orders", params={"after": after, "limit": 10}).json()
            assert page["count"] == 25
            ids += [order["id"] for order in page["orders"]]
            after = page["next"]
            pages += 1
        assert pages == 3
        assert ids == [row[0] for row in order_rows(server)]
        assert http.get("/orders", params={"limit": 0}).status_code == 400
        first = http.get("/orders").json()
        assert first["count"] == len(first["orders"]) == 25
