"""The policies' gate (issue 23): real ``porch demo`` processes, real sockets, counts from rows.

``--global-limit`` (a second level), ``POST /completions`` with ``--token-budget``
(reserve ``max_tokens``, settle what was used), ``--plans`` (limits by a bearer
token's plan) and ``--algorithm`` with ``--burst``, each against one demo on the
embedded store; tests/e2e/test_gate_hosts.py runs them over two hosts on every store.
Clients are told apart by ``X-Forwarded-For`` behind one trusted hop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos

from porch.store import SQLiteStore
from support import wait_until

pytestmark = [pytest.mark.e2e]

TIMEOUT = 30.0
US = "\x1f"
GLOBAL_KEY = f"rl{US}default{US}global{US}"
TOKENS = f"rl{US}completions{US}tokens{US}"


def demo_key(client: str) -> str:
    return f"rl{US}default{US}demo{US}{client}"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def sqlite_decides(algorithm: str) -> None:
    """Skip unless the embedded store decides ``algorithm`` (it says so in its capabilities)."""
    if algorithm not in SQLiteStore("/nonexistent").capabilities.algorithms:
        pytest.skip(f"the SQLite store does not decide {algorithm} limits yet")


def as_client(ip: str, **headers: str) -> dict[str, str]:
    return {"X-Forwarded-For": ip, **headers}


async def _send(
    server: DemoServer, requests: list[tuple[str, str, dict[str, str], object]]
) -> list[httpx.Response]:
    """Every request at once, each on its own connection: (method, path, headers, json)."""
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=TIMEOUT, limits=limits, trust_env=False
    ) as http:
        return list(
            await asyncio.gather(
                *(http.request(m, p, headers=h, json=j) for m, p, h, j in requests)
            )
        )


def send_all(
    server: DemoServer, requests: list[tuple[str, str, dict[str, str], object]]
) -> list[httpx.Response]:
    return asyncio.run(_send(server, requests))


# -- --global-limit: a second level ------------------------------------------------------


def test_a_global_limit_refuses_for_everyone_and_names_its_level(demo: DemoLauncher) -> None:
    server = demo.start(limit=3, window=60, global_limit=5, trust_proxy_hops=1)
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        a = [http.get("/products", headers=as_client("192.0.2.1")) for _ in range(4)]
        b = [http.get("/products", headers=as_client("192.0.2.2")) for _ in range(3)]
    assert [r.status_code for r in a] == [200, 200, 200, 429]
    assert a[3].json()["level"] == "client"
    assert [p["level"] for p in a[3].json()["violated"]] == ["client"]
    assert [r.status_code for r in b] == [200, 200, 429]
    assert b[2].json()["level"] == "global"
    assert b[2].headers["ratelimit-policy"] == '"demo";q=3;w=60, "global";q=5;w=60'
    assert b[2].headers["ratelimit"] == '"demo";r=1;t=60, "global";r=0;t=60'
    assert b[2].headers["x-ratelimit-limit"] == "5"  # the tightest: global, none left
    # A request either level refused consumed nothing at the other.
    rows = server.rows()
    assert rows[demo_key("192.0.2.1")] == 3
    assert rows[demo_key("192.0.2.2")] == 2
    assert rows[GLOBAL_KEY] == 5


def test_a_global_limit_is_exact_under_concurrent_clients(demo: DemoLauncher) -> None:
    # Catches: levels decided apart (a client's count taken while the global level
    # refused, or the other way round), and a global counter losing concurrent hits.
    server = demo.start(limit=2, window=600, global_limit=25, trust_proxy_hops=1)
    ips = [f"198.51.100.{i}" for i in range(1, 41)]
    responses = send_all(server, [("GET", "/products", as_client(ip), None) for ip in ips * 2])
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 25, 429: 55}
    rows = server.rows()
    assert rows[GLOBAL_KEY] == 25
    assert sum(n for key, n in rows.items() if key.startswith(demo_key(""))) == 25


# -- POST /completions: a token budget, reserved and settled ------------------------------


def completion(words: int, max_tokens: int) -> dict[str, object]:
    return {"prompt": " ".join(["word"] * words), "max_tokens": max_tokens}


def test_completions_reserve_then_settle_and_the_budget_holds_under_concurrency(
    demo: DemoLauncher,
) -> None:
    # 60 requests at once, each reserving 100 of a 1000-token budget and using 7: no more
    # than 10 reservations fit at any moment, every refund comes back after its response,
    # and the row ends at exactly 7 per served request.
    server = demo.start(limit=1000, window=600, token_budget=1000)
    request: tuple[str, str, dict[str, str], object] = (
        "POST",
        "/completions",
        {},
        completion(7, 100),
    )
    requests = [request] * 60
    responses = send_all(server, requests)
    served = [r for r in responses if r.status_code == 200]
    assert {r.status_code for r in responses} <= {200, 429}, [r.text for r in responses]
    assert len(served) >= 10
    assert all(r.json() == {"tokens": 7} for r in served)
    assert server.rows()[TOKENS + "127.0.0.1"] == 7 * len(served)
    refused = [r for r in responses if r.status_code == 429]
    for response in refused:
        assert response.json()["violated"][0]["policy"] == "tokens"
        assert int(response.headers["retry-after"]) >= 1
    # What is left is exactly the budget less what was used: a reservation of all of it
    # fits, and once 1 of it is used, all of it no longer does, all of it less 1 does.
    left = 1000 - 7 * len(served)
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        fits = http.post("/completions", json=completion(1, left))
        over = http.post("/completions", json=completion(1, left))
        exact = http.post("/completions", json=completion(1, left - 1))
    assert fits.status_code == 200, fits.text
    assert fits.headers["ratelimit"].startswith('"tokens";r=0;')  # told at the reservation
    assert over.status_code == 429
    assert exact.status_code == 200, exact.text
    assert server.rows()[TOKENS + "127.0.0.1"] == 1000 - left + 2


def test_completions_validate_their_input_and_reserve_nothing_for_bad_requests(
    demo: DemoLauncher,
) -> None:
    server = demo.start(limit=1000, window=600, token_budget=50)
    bodies: list[tuple[bytes, int]] = [
        (b"{nope", 400),
        (b"[]", 400),
        (b'{"prompt": "a"}', 422),
        (b'{"prompt": "a", "max_tokens": 0}', 422),
        (b'{"prompt": "a", "max_tokens": 100001}', 422),
        (b'{"prompt": "a", "max_tokens": 1.5}', 422),
        (b'{"prompt": 7, "max_tokens": 5}', 422),
    ]
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        for body, status in bodies:
            response = http.post(
                "/completions", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, (body, response.text)
            assert response.headers["content-type"] == "application/problem+json"
        too_big = http.post("/completions", json=completion(1, 51))
        fits = http.post("/completions", json=completion(3, 50))
    assert too_big.status_code == 429  # a reservation that does not fit what is left
    assert (fits.status_code, fits.json()) == (200, {"tokens": 3})
    assert server.rows()[TOKENS + "127.0.0.1"] == 3


@pytest.mark.slow
def test_a_reservation_open_when_its_process_is_killed_keeps_the_estimate(
    demo: DemoLauncher,
) -> None:
    server = demo.start(limit=1000, window=600, token_budget=1000, checkout_latency=30)

    async def reserve_then_kill() -> None:
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=TIMEOUT, trust_env=False
        ) as http:
            inside = asyncio.create_task(http.post("/completions", json=completion(3, 600)))
            await asyncio.to_thread(
                wait_until,
                lambda: server.rows().get(TOKENS + "127.0.0.1") == 600,
                "the reservation is committed",
            )
            server.kill()
            with pytest.raises(httpx.HTTPError):
                await inside

    asyncio.run(reserve_then_kill())
    assert server.rows()[TOKENS + "127.0.0.1"] == 600  # committed with the hit
    server.restart()
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        refused = http.post("/completions", json=completion(1, 401))
    assert refused.status_code == 429
    assert server.rows()[TOKENS + "127.0.0.1"] == 600


# -- --plans: limits by the bearer token's plan ------------------------------------------


def test_plans_limit_a_bearer_token_by_its_plan_and_anyone_else_by_the_limit(
    demo: DemoLauncher,
) -> None:
    server = demo.start(limit=1, window=60, plans="free=2/minute,pro=4/minute")

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        free = [http.get("/products", headers=bearer("free-alice")) for _ in range(3)]
        pro = [http.get("/products", headers=bearer("pro-bob")).status_code for _ in range(5)]
        other = [http.get("/products", headers=bearer("gold-carol")).status_code for _ in range(2)]
    assert [r.status_code for r in free] == [200, 200, 429]
    assert free[0].headers["ratelimit-policy"] == '"per-60s";q=2;w=60'
    assert pro == [200] * 4 + [429]
    assert other == [200, 429]  # no such plan: --limit under the client identity
    rows = server.rows()
    assert rows[f"rl{US}default{US}per-60s{US}free-alice"] == 2
    assert rows[f"rl{US}default{US}per-60s{US}pro-bob"] == 4
    assert rows[demo_key("127.0.0.1")] == 1


# -- --algorithm and --burst -------------------------------------------------------------


def test_gcra_lets_a_burst_through_then_one_per_interval(demo: DemoLauncher) -> None:
    sqlite_decides("gcra")
    # 2 per 2 s (one every second), a bucket of 4.
    server = demo.start(limit=2, window=2, algorithm="gcra", burst=4)
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        burst = [http.get("/products") for _ in range(5)]
        assert [r.status_code for r in burst] == [200] * 4 + [429]
        assert burst[0].headers["ratelimit-policy"] == '"demo";q=4;w=4'
        refused = burst[4]
        retry_after = int(refused.headers["retry-after"])
        assert retry_after == 1  # one interval, rounded up
        time.sleep(retry_after)  # Retry-After is never early: the same request passes now
        assert http.get("/products").status_code == 200


@pytest.mark.slow
def test_sliding_counts_the_previous_window_weighted(demo: DemoLauncher) -> None:
    sqlite_decides("sliding")
    server = demo.start(limit=4, window=3, algorithm="sliding")
    with server.client(timeout=TIMEOUT, trust_env=False) as http:
        first = [http.get("/products") for _ in range(5)]
        assert [r.status_code for r in first] == [200] * 4 + [429]
        assert first[0].headers["ratelimit-policy"] == '"demo";q=4;w=3'
        retry_after = int(first[4].headers["retry-after"])
        assert 1 <= retry_after <= math.ceil(3 + 3 / 4)
        time.sleep(retry_after)
        assert http.get("/products").status_code == 200
