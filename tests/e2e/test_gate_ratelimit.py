"""The rate limiter's gate: DESIGN.md's criteria 1-5 and 9 against real ``porch demo`` processes.

Every leg talks HTTP over real loopback sockets to a real server process and
takes its counts from the rows of the SQLite file, never from logs. Each leg
says in a comment which broken mechanism it would catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos, orders_count, source_port

pytestmark = [pytest.mark.e2e]

LOCAL = "127.0.0.1"
PROBLEM_JSON = "application/problem+json"
_RATELIMIT = re.compile(r'"demo";r=(\d+);t=(\d+)')
# Plain-HTTP tests: one TLS context shared by every client, instead of each of hundreds of
# clients loading the CA bundle.
_PLAIN_HTTP = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


# -- helpers -----------------------------------------------------------------------------


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    """Starts demo servers; every one still running at teardown is killed."""
    with launch_demos(tmp_path) as launcher:
        yield launcher


@contextlib.contextmanager
def client(server: DemoServer) -> Iterator[httpx.Client]:
    """One keep-alive connection's worth of sequential requests."""
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as http:
        yield http


def fresh_get(
    server: DemoServer, path: str = "/products", headers: Mapping[str, str] | None = None
) -> tuple[httpx.Response, int]:
    """GET on a brand-new TCP connection; returns the response and the local (source) port."""
    with (
        httpx.Client(
            base_url=server.base_url,
            timeout=10.0,
            trust_env=False,
            headers={"Connection": "close"},
        ) as http,
        http.stream("GET", path, headers=headers) as response,
    ):
        port = source_port(response)  # before the body is read: the server then closes
        response.read()
    return response, port


async def open_connections(
    stack: contextlib.AsyncExitStack, server: DemoServer, n: int
) -> list[httpx.AsyncClient]:
    """``n`` clients, each holding one established keep-alive connection.

    The connections are opened on the exempt /health (it consumes no quota), so a
    burst then goes out on n sockets at once instead of queueing behind a few pooled ones.
    """
    clients = [
        await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=server.base_url, timeout=30.0, trust_env=False, verify=_PLAIN_HTTP
            )
        )
        for _ in range(n)
    ]
    warm = await asyncio.gather(*(http.get("/health") for http in clients))
    assert all(r.status_code == 200 for r in warm)
    return clients


async def _burst(server: DemoServer, n: int) -> tuple[list[httpx.Response], set[int]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_connections(stack, server, n)
        responses = await asyncio.gather(*(http.get("/products") for http in clients))
        ports = {source_port(r) for r in responses}
    return list(responses), ports


def burst(server: DemoServer, n: int) -> tuple[list[httpx.Response], set[int]]:
    """``n`` GET /products in flight at once, each on its own connection.

    Returns the responses and the set of source ports they arrived on.
    """
    return asyncio.run(_burst(server, n))


def statuses(responses: Sequence[httpx.Response]) -> Counter[int]:
    return Counter(r.status_code for r in responses)


def check_limited_headers(
    response: httpx.Response,
    *,
    limit: int,
    window: int,
    remaining: int,
    wall_before: float,
    wall_after: float,
    wall_offset: float = 0.0,
) -> int:
    """Check the five rate-limit headers; return ``t`` from ``RateLimit``.

    ``wall_offset`` is how far the server's wall clock is from ours.
    """
    h = response.headers
    assert h["X-RateLimit-Limit"] == str(limit)
    assert h["X-RateLimit-Remaining"] == str(remaining)
    reset_text = h["X-RateLimit-Reset"]
    assert reset_text.isdigit(), f"X-RateLimit-Reset is not integer Unix seconds: {reset_text!r}"
    reset = int(reset_text)
    # ceil(wall at the decision + time left in the window): within [now, now + window + 1].
    low = math.floor(wall_before + wall_offset)
    high = math.ceil(wall_after + wall_offset) + window + 1
    assert low <= reset <= high, (reset, low, high)
    assert h["RateLimit-Policy"] == f'"demo";q={limit};w={window}'
    match = _RATELIMIT.fullmatch(h["RateLimit"])
    assert match is not None, h["RateLimit"]
    assert int(match[1]) == remaining
    t = int(match[2])
    assert 1 <= t <= window
    # t (delta seconds) and X-RateLimit-Reset (Unix seconds) name the same instant.
    slack = 2 + (wall_after - wall_before)
    assert abs((wall_before + wall_offset + t) - reset) <= slack, (t, reset, wall_before)
    return t


def check_refusal(response: httpx.Response, *, limit: int, window: int, t: int) -> int:
    """Check a 429's retry hint and problem body; return Retry-After."""
    assert response.status_code == 429, response.text
    retry_text = response.headers["Retry-After"]
    assert retry_text.isdigit(), f"Retry-After is not integer seconds: {retry_text!r}"
    retry_after = int(retry_text)
    assert retry_after >= 1
    assert retry_after >= t, "Retry-After earlier than the RateLimit t"
    assert retry_after <= window
    assert response.headers["Content-Type"].split(";")[0] == PROBLEM_JSON
    body = response.json()
    assert {"type", "title", "status", "detail", "violated"} <= set(body), body
    assert isinstance(body["type"], str)
    assert isinstance(body["title"], str)
    assert isinstance(body["detail"], str)
    assert body["status"] == 429
    assert isinstance(body["violated"], list)
    assert len(body["violated"]) == 1, body
    (violated,) = body["violated"]
    assert violated["policy"] == "demo"
    assert violated["limit"] == limit
    assert violated["window"] == window
    assert isinstance(violated["reset_after"], int)
    assert 1 <= violated["reset_after"] <= retry_after
    return retry_after


def random_ips(n: int, seed: int) -> list[str]:
    """``n`` distinct addresses from the documentation ranges (never 127.0.0.1)."""
    rng = random.Random(seed)
    ips: set[str] = set()
    while len(ips) < n:
        net = rng.choice(("192.0.2", "198.51.100", "203.0.113"))
        ips.add(f"{net}.{rng.randrange(1, 255)}")
    return sorted(ips)


def exhaust(http: httpx.Client, *, bound: int) -> int:
    """Send GET /products until the first 429 (at most ``bound`` 200s); return the 200s."""
    for served in range(bound + 1):
        response = http.get("/products")
        if response.status_code == 429:
            return served
        assert response.status_code == 200, response.text
    pytest.fail(f"no 429 within {bound + 1} requests")


# -- 1. N requests pass, N+1 is refused with a retry hint ------------------------------------


def test_burst_crosses_exactly_at_limit(demo: DemoLauncher) -> None:
    # Catches: an off-by-one at the limit (allowing count < limit or count <= limit + 1),
    # wrong or missing headers, a 429 without a usable retry hint, a refused request whose
    # handler still ran, and an exempt path that consumes quota or gets limited.
    server = demo.start(limit=10, window=60)
    routes = (
        ("GET", "/products", None, 200),
        ("GET", "/orders", None, 200),
        ("POST", "/orders", {"item": "tea", "qty": 2}, 201),
    )
    with client(server) as http:
        for _ in range(15):
            health = http.get("/health")
            assert health.status_code == 200
            assert health.json() == {"ok": True}
            assert "X-RateLimit-Remaining" not in health.headers
        assert server.counters() == {}, "GET /health consumed quota"

        posts = 0
        for i in range(10):
            method, path, payload, expected = routes[i % len(routes)]
            before = time.time()
            response = http.request(method, path, json=payload)
            after = time.time()
            assert response.status_code == expected, (i, response.text)
            posts += method == "POST"
            check_limited_headers(
                response,
                limit=10,
                window=60,
                remaining=9 - i,
                wall_before=before,
                wall_after=after,
            )
            # Exempt calls between limited ones: Remaining keeps stepping by exactly one.
            assert http.get("/health").status_code == 200

        assert server.count_for(LOCAL) == 10
        assert orders_count(server) == posts

        # Request 11, as a POST: refused, and the handler did not run.
        before = time.time()
        refused = http.post("/orders", json={"item": "chair", "qty": 1})
        after = time.time()
        assert refused.status_code == 429, refused.text
        t = check_limited_headers(
            refused, limit=10, window=60, remaining=0, wall_before=before, wall_after=after
        )
        check_refusal(refused, limit=10, window=60, t=t)
        assert orders_count(server) == posts, "a refused POST /orders ran its handler"
        # Every other limited route is refused too; /health still is not.
        assert http.get("/products").status_code == 429
        assert http.get("/orders").status_code == 429
        for _ in range(15):
            assert http.get("/health").status_code == 200

    # A refused request consumes nothing; /health never did.
    assert server.count_for(LOCAL) == 10
    assert list(server.counters()) == [LOCAL]


# -- 5. N genuinely concurrent requests count exactly N ---------------------------------------


def test_concurrent_requests_count_exactly(demo: DemoLauncher) -> None:
    # Catches: a read-modify-write from request tasks (lost increments let more than 50
    # through and leave count < 50), and decisions not serialized per key (two requests
    # seeing the same count: duplicate Remaining values).
    limit, n = 50, 80
    server = demo.start(limit=limit, window=60)
    responses, ports = burst(server, n)
    # Genuine parallelism: the burst really went out over many connections at once.
    assert len(ports) == n, f"only {len(ports)} connections carried the burst"
    assert statuses(responses) == Counter({200: limit, 429: n - limit})
    served_remaining = sorted(
        int(r.headers["X-RateLimit-Remaining"]) for r in responses if r.status_code == 200
    )
    assert served_remaining == list(range(limit)), "two requests were given the same count"
    assert all(r.headers["X-RateLimit-Remaining"] == "0" for r in responses if r.status_code == 429)
    assert server.count_for(LOCAL) == limit
    assert list(server.counters()) == [LOCAL]


# -- the key is the peer host: a new connection is not a new client ----------------------------


def test_new_connections_from_one_host_share_a_counter(demo: DemoLauncher) -> None:
    # Catches: keying on host:port (or on the connection), which gives every new
    # connection a fresh allowance.
    server = demo.start(limit=5, window=60)
    results = [fresh_get(server) for _ in range(8)]
    ports = [port for _, port in results]
    assert len(set(ports)) == 8, f"connections were reused: source ports {ports}"
    codes = [r.status_code for r, _ in results]
    assert codes == [200] * 5 + [429] * 3
    assert [r.headers["X-RateLimit-Remaining"] for r, _ in results[:5]] == ["4", "3", "2", "1", "0"]
    assert server.count_for(LOCAL) == 5
    assert list(server.counters()) == [LOCAL]


# -- forwarding headers are trusted only when the deployer says so -------------------------


def test_spoofed_forwarded_for_is_ignored_without_trusted_proxies(demo: DemoLauncher) -> None:
    # Catches: trusting X-Forwarded-For by default (in porch or in the server under it),
    # which lets any client mint a fresh allowance per request by inventing an address.
    server = demo.start(limit=3, window=60)
    spoofed = random_ips(6, seed=4)
    codes = [fresh_get(server, headers={"X-Forwarded-For": ip})[0].status_code for ip in spoofed]
    assert codes == [200, 200, 200, 429, 429, 429], (codes, server.counters())
    assert list(server.counters()) == [LOCAL]
    assert server.count_for(LOCAL) == 3


def test_trusted_proxy_hop_separates_forwarded_clients(demo: DemoLauncher) -> None:
    # Catches: ignoring --trust-proxy-hops (everyone behind the proxy would share the
    # proxy's counter), or walking from the wrong end of the header.
    server = demo.start(limit=3, window=60, trust_proxy_hops=1)
    clients = random_ips(4, seed=41)
    with client(server) as http:
        for ip in clients:
            for remaining in (2, 1):
                response = http.get("/products", headers={"X-Forwarded-For": ip})
                assert response.status_code == 200, (ip, response.text)
                assert response.headers["X-RateLimit-Remaining"] == str(remaining)
        # The proxy appends the real client on the right; a client-written entry on the
        # left is not the key.
        first = clients[0]
        chain = {"X-Forwarded-For": f"6.6.6.6, {first}"}
        assert http.get("/products", headers=chain).status_code == 200
        assert http.get("/products", headers=chain).status_code == 429
    rows = server.counters()
    assert set(rows) == set(clients), rows
    assert {ip: row.count for ip, row in rows.items()} == {
        ip: (3 if ip == first else 2) for ip in clients
    }


# -- 2. counters at their limit survive SIGTERM and kill -9 -------------------------------------


def test_sigterm_leaves_no_wal_behind(demo: DemoLauncher) -> None:
    # Catches: a connection left open at shutdown (its WAL and shared-memory files stay
    # beside the database). Both of the demo's files: porch's and its own orders'.
    server = demo.start(limit=5, window=60)
    with client(server) as http:
        order = http.post(
            "/orders", json={"item": "tea", "qty": 1}, headers={"Idempotency-Key": "wal-1"}
        )
        assert order.status_code == 201, order.text
    assert server.db_path.with_name("orders.sqlite3-wal").exists()  # (in WAL mode, open)
    server.terminate()
    for name in ("porch.sqlite3-wal", "orders.sqlite3-wal"):
        assert not server.db_path.with_name(name).exists(), server.output()


def test_limit_survives_sigterm_restart(demo: DemoLauncher) -> None:
    # Catches: counters kept only in memory, or buffered writes lost at shutdown.
    server = demo.start(limit=5, window=60)
    with client(server) as http:
        assert exhaust(http, bound=10) == 5
    server.terminate()
    # The store closed cleanly: the last connection checkpointed and removed the WAL.
    assert not server.db_path.with_name("porch.sqlite3-wal").exists(), server.output()
    server.restart()
    with client(server) as http:
        before = time.time()
        response = http.get("/products")
        after = time.time()
    assert response.status_code == 429, response.text
    t = check_limited_headers(
        response, limit=5, window=60, remaining=0, wall_before=before, wall_after=after
    )
    check_refusal(response, limit=5, window=60, t=t)
    assert server.count_for(LOCAL) == 5


def test_kill_9_loses_no_served_request(demo: DemoLauncher) -> None:
    # Catches: answering before the counter is committed (group commit replying early),
    # or a commit that does not reach the OS before the reply: the 200s served before
    # the kill would not all be in the file.
    limit = 20
    server = demo.start(limit=limit, window=60)
    responses, _ = burst(server, 12)
    served = statuses(responses)[200]
    assert served == 12, statuses(responses)
    server.kill()
    server.restart()
    assert server.count_for(LOCAL) == served
    with client(server) as http:
        response = http.get("/products")
        assert response.status_code == 200
        assert response.headers["X-RateLimit-Remaining"] == str(limit - served - 1)
        total = served + 1 + exhaust(http, bound=limit)
    assert total == limit
    assert server.count_for(LOCAL) == limit


def test_kill_9_mid_burst_never_loses_an_answered_request(demo: DemoLauncher) -> None:
    # Catches the same early reply, under load: SIGKILL lands while requests are in
    # flight. Every 200 that reached a client must be in the file; requests that were
    # counted but never answered may be (a counted request is never an uncounted one).
    server = demo.start(limit=10_000, window=60)
    n = 60

    async def run() -> list[httpx.Response | BaseException]:
        async with contextlib.AsyncExitStack() as stack:
            clients = await open_connections(stack, server, n)
            tasks = [asyncio.create_task(http.get("/products")) for http in clients]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            server.kill()
            return list(await asyncio.gather(*tasks, return_exceptions=True))

    outcomes = asyncio.run(run())
    served = sum(isinstance(o, httpx.Response) and o.status_code == 200 for o in outcomes)
    assert served >= 1
    assert all(
        isinstance(o, httpx.HTTPError) or (isinstance(o, httpx.Response) and o.status_code == 200)
        for o in outcomes
    ), outcomes
    server.restart()
    counted = server.count_for(LOCAL)
    assert served <= counted <= n, (served, counted)


# -- 3. a fully elapsed window serves again; the expired row is pruned ------------------------


@pytest.mark.slow
def test_elapsed_window_serves_again_and_prunes(demo: DemoLauncher) -> None:
    # Catches: a window that never ends (expired row not overwritten), a delete+insert
    # or a fresh row instead of an in-place overwrite (window_start must move forward on
    # the same key), and a table that grows without bound (no incremental prune).
    server = demo.start(limit=2, window=2, trust_proxy_hops=1)
    a = {"X-Forwarded-For": "10.0.0.1"}
    b = {"X-Forwarded-For": "10.0.0.2"}
    with client(server) as http:
        for headers in (a, b):
            assert [http.get("/products", headers=headers).status_code for _ in range(3)] == [
                200,
                200,
                429,
            ]
        rows = server.counters()
        assert set(rows) == {"10.0.0.1", "10.0.0.2"}
        old_a = rows["10.0.0.1"]
        assert old_a.count == 2
        assert rows["10.0.0.2"].count == 2
        # window_start / expires are CLOCK_MONOTONIC seconds, the same clock as ours.
        assert old_a.expires == pytest.approx(old_a.window_start + 2)
        end = max(row.expires for row in rows.values())
        wait = end - time.monotonic() + 0.3
        assert wait < 5, f"rows expire {wait:.1f} s from now, beyond a 2 s window"
        time.sleep(max(wait, 0))

        response = http.get("/products", headers=a)
        assert response.status_code == 200, response.text
        assert response.headers["X-RateLimit-Remaining"] == "1"
    rows = server.counters()
    assert set(rows) == {"10.0.0.1"}, f"expired row not pruned: {rows}"
    new_a = rows["10.0.0.1"]
    assert new_a.count == 1
    assert new_a.window_start > old_a.expires - 1e-6
    assert new_a.expires == pytest.approx(new_a.window_start + 2)
    assert new_a.wall_start > old_a.wall_start


# -- 4. the wall clock jumping grants nothing --------------------------------------------------


_SPIN_TWO_THREADS = """
import resource, threading, time
def spin(until):
    while time.monotonic() < until:
        pass
before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
until = time.monotonic() + 0.5
other = threading.Thread(target=spin, args=(until,))
other.start()
spin(until)
other.join()
print(time.time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
"""


@pytest.mark.parametrize("offset", ["+2h", "-2h"])
def test_the_faked_wall_clock_leaves_the_gil_alone(demo: DemoLauncher, offset: str) -> None:
    # Catches: the harness preloading libfaketime so that CPython's GIL waits time out at
    # once (demo_server.faketime_env): two threads that share the GIL for 0.5 s then
    # switch some 17,000 times instead of a few hundred, and a server's threads starve
    # one another on a busy machine (a demo took 33 s to start). Also that the wall
    # clock really moves.
    env = {**os.environ, **demo.faketime_env(offset)}
    done = subprocess.run(
        [sys.executable, "-c", _SPIN_TWO_THREADS],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    wall, switches = done.stdout.split()
    assert abs(float(wall) - time.time() - (7200 if offset == "+2h" else -7200)) < 60
    assert int(switches) < 5000, f"{switches} voluntary context switches in 0.5 s"


def test_wall_clock_jump_grants_nothing(demo: DemoLauncher) -> None:
    # Catches: windows measured on the wall clock (2 h ahead, the window "elapsed" and
    # the client is served again), or a store that treats a restart as a reboot and
    # rebases windows on the wall clock; and, 2 h behind, an implementation that
    # resets a window whose start lies "in the future".
    env_forward = demo.faketime_env("+2h")  # skips when libfaketime is not installed
    env_backward = demo.faketime_env("-2h")

    server = demo.start(limit=3, window=60)
    with client(server) as http:
        assert exhaust(http, bound=10) == 3
    original = server.counters()[LOCAL]
    server.terminate()

    for env, offset in ((env_forward, 7200.0), (env_backward, -7200.0)):
        server.restart(env=env)
        with client(server) as http:
            before = time.time()
            response = http.get("/products")
            after = time.time()
        assert response.status_code == 429, f"wall clock {env['FAKETIME']} granted a request"
        # The server really runs on the shifted wall clock: its Reset is about offset away.
        t = check_limited_headers(
            response,
            limit=3,
            window=60,
            remaining=0,
            wall_before=before,
            wall_after=after,
            wall_offset=offset,
        )
        check_refusal(response, limit=3, window=60, t=t)
        row = server.counters()[LOCAL]
        assert row.count == 3
        assert row.window_start == original.window_start
        assert row.expires == original.expires
        server.terminate()


# -- 9. a saturated pool refuses with 503 rather than serving uncounted ------------------------


def test_saturated_pool_answers_503_and_serves_nothing_uncounted(demo: DemoLauncher) -> None:
    # Catches: a full mailbox that waits (no 503 ever), or that lets the request through
    # uncounted (more 200s than the counter holds), or a 503 without a retry hint/cause.
    server = demo.start(limit=1000, window=60, pool_size=1, mailbox=1)
    served = saturated = 0
    for _attempt in range(3):
        responses, _ = burst(server, 150)
        codes = statuses(responses)
        assert set(codes) <= {200, 503}, codes
        served += codes[200]
        for response in responses:
            if response.status_code != 503:
                continue
            saturated += 1
            retry = response.headers["Retry-After"]
            assert retry.isdigit(), retry
            assert int(retry) >= 1
            assert response.headers["Content-Type"].split(";")[0] == PROBLEM_JSON
            body = response.json()
            assert body["status"] == 503
            assert body["cause"] == "saturated", body
        if saturated:
            break
    assert saturated > 0, "150 concurrent requests never saturated a 1-slot mailbox"
    assert server.count_for(LOCAL) == served
