"""The security review's findings (issue 12, THREATS.md) against real ``porch demo`` processes.

Real loopback sockets; a second client is another loopback source address
(127.0.0.2), which the server sees as another peer. Counts come from the rows
of the SQLite files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos, orders_count

pytestmark = [pytest.mark.e2e]

ALICE = "127.0.0.1"
BOB = "127.0.0.2"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def http(server: DemoServer, source: str = ALICE) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=server.base_url, transport=transport, timeout=30.0)


def order(item: str) -> bytes:
    return json.dumps({"item": item, "qty": 1}).encode()


def keyed(key: str) -> dict[str, str]:
    return {"content-type": "application/json", "idempotency-key": key}


def test_two_anonymous_clients_with_one_key_never_share_a_response(demo: DemoLauncher) -> None:
    # Catches: a default scope shared by every caller without Authorization (finding 1).
    server = demo.start(limit=100, window=60)
    with http(server, ALICE) as alice, http(server, BOB) as bob:
        mine = alice.post("/orders", content=order("tea"), headers=keyed("order-1"))
        same = bob.post("/orders", content=order("tea"), headers=keyed("order-1"))
        probe = bob.post("/orders", content=order("lamp"), headers=keyed("order-2"))
        other = alice.post("/orders", content=order("chair"), headers=keyed("order-2"))
        replay = alice.post("/orders", content=order("tea"), headers=keyed("order-1"))
    assert mine.status_code == same.status_code == 201
    assert "idempotent-replayed" not in same.headers
    assert same.json()["id"] != mine.json()["id"]
    # Bob's own order-2 does not make alice's a 422, nor does alice's exist for bob.
    assert probe.status_code == other.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == mine.content
    assert orders_count(server) == 4


def test_head_after_the_limit_is_429(demo: DemoLauncher) -> None:
    # Catches: a rule that lets HEAD through (the GET handler runs) (finding 6).
    server = demo.start(limit=3, window=60)
    with http(server) as c:
        codes = [c.get("/products").status_code for _ in range(3)]
        head = c.head("/products")
    assert codes == [200] * 3
    assert head.status_code == 429
    assert server.count_for(ALICE) == 3


def test_padding_x_forwarded_for_at_429_behind_a_trusted_proxy_changes_nothing(
    demo: DemoLauncher,
) -> None:
    # Catches: hop and size limits counting client-written entries, and overflow
    # falling back to the proxy's key (finding 4). The test client plays both the
    # client (the junk on the left) and the proxy (the entry appended on the right).
    server = demo.start(limit=2, window=60, trust_proxy_hops=1)
    me = "203.0.113.7"
    with http(server) as proxy:
        for _ in range(2):
            assert proxy.get("/products", headers={"x-forwarded-for": me}).status_code == 200
        for junk in ("1.1.1.1, " * 400, "x" * 6000, "junk,,," * 100, 'for="a, ' * 50):
            r = proxy.get("/products", headers={"x-forwarded-for": f"{junk}, {me}"})
            assert r.status_code == 429, junk[:30]
        honest = proxy.get("/products", headers={"x-forwarded-for": "198.51.100.1"})
    assert honest.status_code == 200
    counters = server.counters()
    assert counters[me].count == 2
    assert ALICE not in counters  # nothing was counted under the proxy's own key


def _client(server: DemoServer, source: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=server.base_url,
        transport=httpx.AsyncHTTPTransport(local_address=source),
        timeout=60.0,
    )


async def _flood(
    server: DemoServer, flood: int, interleaved: int
) -> tuple[Counter[int], list[int]]:
    """``flood`` requests of alice at once, each on its own pre-opened connection, with
    ``interleaved`` requests of bob (on his own connections) spread evenly through them.
    Returns alice's statuses and bob's."""
    async with contextlib.AsyncExitStack() as stack:
        alice = [await stack.enter_async_context(_client(server, ALICE)) for _ in range(flood)]
        bob = [await stack.enter_async_context(_client(server, BOB)) for _ in range(interleaved)]
        # Open every connection first, on the exempt /health (it consumes nothing).
        warm = await asyncio.gather(*(c.get("/health") for c in [*alice, *bob]))
        assert {r.status_code for r in warm} == {200}
        every = flood // interleaved
        order = [(ALICE, c) for c in alice]
        for i, c in enumerate(bob):
            order.insert(i * (every + 1) + every // 2, (BOB, c))
        responses = await asyncio.gather(*(c.get("/products") for _, c in order))
    codes = [(who, r.status_code) for (who, _), r in zip(order, responses, strict=True)]
    return Counter(code for who, code in codes if who == ALICE), [
        code for who, code in codes if who == BOB
    ]


def test_a_client_at_429_flooding_does_not_turn_others_away(demo: DemoLauncher) -> None:
    # Catches: refusals of a client known to be over its limit taking mailbox slots, so
    # its flood makes other clients of its shard get 503 (finding 2; the numbers:
    # a burst of 500 with pool 1 / mailbox 32, 15 interleaved requests of another client).
    server = demo.start(limit=20, window=120, pool_size=1, mailbox=32)
    with http(server) as alice:
        assert [alice.get("/products").status_code for _ in range(20)] == [200] * 20
        assert alice.get("/products").status_code == 429
    alice_codes, bob_codes = asyncio.run(_flood(server, 500, 15))
    assert bob_codes == [200] * 15, bob_codes
    assert alice_codes == Counter({429: 500}), alice_codes
    # Refusals consume nothing, and every allowed request was counted: exact rows.
    counters = server.counters()
    assert counters[ALICE].count == 20
    assert counters[BOB].count == 15
