"""The multi-worker gate: exact and idempotent across worker processes on one host.

Every leg runs ``porch demo --workers 4``: uvicorn's supervisor and four worker
processes that accept on one shared listening socket and share one data
directory. Counts come from the SQLite rows (the ``counters`` row, the
``orders`` table), worker identity from the ``X-Demo-Worker`` header and from
``/proc`` (which worker holds a connection's socket; worker CPU time), never
from logs. Each leg says in a comment which broken mechanism it would catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from demo_server import (
    DemoLauncher,
    DemoServer,
    launch_demos,
    order_rows,
    parked_waiters,
    read_response,
)

from support import sqlite_claims, wait_until

pytestmark = [pytest.mark.e2e]

WORKERS = 4
LOCAL = "127.0.0.1"
WORKER_HEADER = "X-Demo-Worker"
REPLAYED = "Idempotent-Replayed"
BIG_LIMIT = 10_000  # keeps the demo's rate limiter out of the idempotency legs
CLIENT_TIMEOUT = 15.0  # under the 30 s waiter deadline: a stranded waiter fails fast
WORKERS_READY_TIMEOUT = 15.0
# Plain-HTTP tests: one TLS context shared by every client, instead of each of hundreds of
# clients loading the CA bundle.
_PLAIN_HTTP = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    """Starts demo servers; at teardown each server's whole process group is killed."""
    with launch_demos(tmp_path) as launcher:
        yield launcher


def order(item: str = "tea", qty: int = 1) -> bytes:
    return json.dumps({"item": item, "qty": qty}, separators=(",", ":")).encode()


def keyed(key: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Idempotency-Key": key}


def is_replay(response: httpx.Response) -> bool:
    values: list[str] = response.headers.get_list(REPLAYED)
    assert values in ([], ["true"]), f"{REPLAYED}: {values!r}"
    return bool(values)


def worker_of(response: httpx.Response) -> int:
    return int(response.headers[WORKER_HEADER])


def spread(responses: Sequence[httpx.Response]) -> Counter[int]:
    """How many of ``responses`` each worker pid served."""
    return Counter(worker_of(r) for r in responses)


# -- /proc: the supervisor's workers, their CPU time, the holder of a connection --------------


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def _state(pid: int) -> str | None:
    """The process state letter (R, S, Z...), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def worker_pids(server: DemoServer) -> set[int]:
    """The live uvicorn workers: the supervisor's spawned children (not its resource tracker)."""
    proc = server.proc
    assert proc is not None
    workers: set[int] = set()
    for kid in _children(proc.pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"spawn_main" in cmdline and _state(kid) not in (None, "Z"):
            workers.add(kid)
    return workers


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_socket_inode(server_port: int, client_port: int) -> int | None:
    """The inode of the server-side socket of the loopback connection from ``client_port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                inode = int(fields[9])
                if local_port == server_port and remote_port == client_port and inode:
                    return inode
    return None


def socket_holder(server: DemoServer, client_port: int) -> int | None:
    """The worker pid with an fd on the server end of the connection from ``client_port``."""
    inode = _server_socket_inode(server.port, client_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    holders: set[int] = set()
    for pid in worker_pids(server):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    if os.readlink(fd) == target:
                        holders.add(pid)
    assert len(holders) <= 1, f"several workers hold one connection: {holders}"
    return holders.pop() if holders else None


# -- clients --------------------------------------------------------------------------------


def _async_client(server: DemoServer, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=server.base_url,
        timeout=CLIENT_TIMEOUT,
        trust_env=False,
        verify=_PLAIN_HTTP,
        **kwargs,
    )


async def fresh_request(
    server: DemoServer,
    method: str,
    path: str,
    *,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One request on a brand-new TCP connection, closed after the response."""
    async with _async_client(server, headers={"Connection": "close"}) as http:
        response = await http.request(method, path, content=content, headers=headers)
    assert response.headers.get("Connection", "").lower() == "close", response.headers
    return response


def wait_for_all_workers(server: DemoServer) -> set[int]:
    """Wait (bounded) until all four workers exist and each has served a GET /health.

    The launcher returns as soon as one worker answers; the others may still be
    booting, and a leg fired then would reach fewer workers than it could. /health is
    exempt from the limiter, so this costs no quota. Returns the pids seen serving.
    """

    async def probe() -> set[int]:
        seen: set[int] = set()
        deadline = time.monotonic() + WORKERS_READY_TIMEOUT
        while time.monotonic() < deadline:
            live = worker_pids(server)
            if len(live) == WORKERS and live <= seen:
                break
            responses = await asyncio.gather(
                *(fresh_request(server, "GET", "/health") for _ in range(8))
            )
            assert all(r.status_code == 200 for r in responses)
            seen |= set(spread(responses))
            await asyncio.sleep(0.05)
        return seen & worker_pids(server)

    serving = asyncio.run(probe())
    live = worker_pids(server)
    assert len(live) == WORKERS, f"expected {WORKERS} workers, found {sorted(live)}"
    # The legs assert their own spread; this only makes sure several workers can take part.
    assert len(serving) >= 2, f"only workers {sorted(serving)} of {sorted(live)} ever served"
    return serving


@dataclass(slots=True)
class Conn:
    """One established keep-alive connection and the worker that accepted it."""

    http: httpx.AsyncClient
    worker: int


async def open_spread(
    stack: contextlib.AsyncExitStack, server: DemoServer, n: int, *, bound: int
) -> list[Conn]:
    """``n`` keep-alive connections (more, up to ``bound``, until ≥ 2 workers hold some).

    Each is opened on the exempt GET /health, whose X-Demo-Worker names the worker that
    accepted it; a burst then goes out on all of them at once.
    """
    conns: list[Conn] = []

    async def open_more(k: int) -> None:
        clients = [
            await stack.enter_async_context(
                _async_client(
                    server, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
                )
            )
            for _ in range(k)
        ]
        warm = await asyncio.gather(*(http.get("/health") for http in clients))
        assert all(r.status_code == 200 for r in warm)
        conns.extend(Conn(http, worker_of(r)) for http, r in zip(clients, warm, strict=True))

    await open_more(n)
    while len({c.worker for c in conns}) < 2 and len(conns) < bound:
        await open_more(min(4, bound - len(conns)))
    workers = Counter(c.worker for c in conns)
    assert len(workers) >= 2, f"{len(conns)} connections all landed on one worker: {workers}"
    return conns


# -- raw HTTP over a plain socket (leg 4 needs the connection's local port) ------------------


def send_request(
    sock: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> None:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {LOCAL}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body)


# -- 1. fresh connections spread over the workers are counted exactly -------------------------


def test_fresh_connections_across_workers_count_exactly(demo: DemoLauncher) -> None:
    # Catches: counters cached or decided per process (each worker would grant its own
    # 100: up to 400 served), a read-modify-write across processes (lost increments: more
    # than 100 served, a row below 100, two requests handed the same Remaining), and
    # keying on host:port (every new connection a new client: all 400 served).
    limit, n, concurrency = 100, 400, 48
    server = demo.start(limit=limit, window=60, workers=WORKERS, worker_header=True)
    wait_for_all_workers(server)

    async def run() -> list[httpx.Response]:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> httpx.Response:
            async with gate:
                return await fresh_request(server, "GET", "/products")

        return list(await asyncio.gather(*(one() for _ in range(n))))

    started = time.monotonic()
    responses = asyncio.run(run())
    elapsed = time.monotonic() - started
    codes = Counter(r.status_code for r in responses)
    workers = spread(responses)
    served = [r for r in responses if r.status_code == 200]
    print(f"\nleg 1: {n} fresh connections in {elapsed:.2f} s; {codes}; workers {dict(workers)}")
    assert codes == Counter({200: limit, 429: n - limit}), (codes, workers)
    remaining = sorted(int(r.headers["X-RateLimit-Remaining"]) for r in served)
    assert remaining == list(range(limit)), "two requests in different workers saw one count"
    assert len(workers) >= 2, f"every response came from one worker: {workers}"
    assert set(workers) <= worker_pids(server), "a response named a pid that is not a worker"
    assert server.count_for(LOCAL) == limit
    assert list(server.counters()) == [LOCAL]


# -- 2. a burst fired at once across workers is counted exactly -------------------------------


def test_concurrent_burst_across_workers_counts_exactly(demo: DemoLauncher) -> None:
    # Catches: the cross-process serialization point missing (the SQLite write
    # transaction replaced by per-process locking or a racy read-then-write): 200
    # requests in flight at once in four processes would let more than 150 through and
    # duplicate Remaining values; and per-process counters (each worker grants 150).
    limit, n = 150, 200
    server = demo.start(limit=limit, window=60, workers=WORKERS, worker_header=True)
    wait_for_all_workers(server)

    async def run() -> tuple[list[Conn], list[httpx.Response], float]:
        async with contextlib.AsyncExitStack() as stack:
            conns = await open_spread(stack, server, n, bound=n)
            started = time.monotonic()
            responses = await asyncio.gather(*(c.http.get("/products") for c in conns))
            return conns, list(responses), time.monotonic() - started

    conns, responses, elapsed = asyncio.run(run())
    codes = Counter(r.status_code for r in responses)
    workers = spread(responses)
    served_by = spread([r for r in responses if r.status_code == 200])
    print(
        f"\nleg 2: burst of {n} in {elapsed:.2f} s; {codes}; workers {dict(workers)};"
        f" 200s by worker {dict(served_by)}"
    )
    assert len(conns) == n
    assert codes == Counter({200: limit, 429: n - limit}), (codes, workers)
    remaining = sorted(
        int(r.headers["X-RateLimit-Remaining"]) for r in responses if r.status_code == 200
    )
    assert remaining == list(range(limit)), "two requests in different workers saw one count"
    assert len(workers) >= 2, f"the burst reached one worker only: {workers}"
    assert len(served_by) >= 2, f"only one worker served: {served_by}"
    assert server.count_for(LOCAL) == limit
    assert list(server.counters()) == [LOCAL]


# -- 3. identical keyed requests in several workers at once: one execution --------------------


def test_identical_keyed_requests_across_workers_execute_once(demo: DemoLauncher) -> None:
    # Catches: ownership kept per process only (the in-process shard state without the
    # cross-process key lock): each worker would own the key and run the handler, giving
    # one order row and one non-replayed response per worker. Also waiters that are
    # refused (409/422) instead of parked, and waiters that poll or sleep before looking
    # again (total time well over one 2 s checkout).
    latency = 2.0
    server = demo.start(
        limit=BIG_LIMIT, window=60, workers=WORKERS, checkout_latency=latency, worker_header=True
    )
    wait_for_all_workers(server)
    body = order("chair", 2)

    async def run() -> tuple[list[Conn], list[httpx.Response], float]:
        async with contextlib.AsyncExitStack() as stack:
            conns = await open_spread(stack, server, 12, bound=40)
            started = time.monotonic()
            responses = await asyncio.gather(
                *(c.http.post("/orders", content=body, headers=keyed("k-across")) for c in conns)
            )
            return conns, list(responses), time.monotonic() - started

    conns, responses, elapsed = asyncio.run(run())
    opened_on = Counter(c.worker for c in conns)
    workers = spread(responses)
    print(
        f"\nleg 3: {len(conns)} connections on workers {dict(opened_on)};"
        f" responses by worker {dict(workers)}; {elapsed:.2f} s"
    )
    assert [r.status_code for r in responses] == [201] * len(conns), [
        (r.status_code, r.text) for r in responses
    ]
    assert len({r.content for r in responses}) == 1, "duplicates got different bodies"
    owners = [r for r in responses if not is_replay(r)]
    assert len(owners) == 1, f"{len(owners)} executions, by workers {spread(owners)}"
    assert order_rows(server) == [(1, "chair", 2)], "the handler ran in more than one worker"
    assert len(workers) >= 2, f"the duplicates were all answered by one worker: {workers}"
    assert elapsed < latency + 1.5, f"{elapsed:.2f} s for one {latency} s checkout"
    assert elapsed >= latency - 0.1, f"{elapsed:.2f} s: the checkout did not run"


# -- 4. a worker killed mid-checkout: its key is taken over at once ---------------------------


def test_worker_killed_mid_checkout_frees_the_key(demo: DemoLauncher) -> None:
    # Catches: ownership that outlives its process (a durable pending marker or a lease,
    # or a lock the kernel does not drop with the process): the retry in another worker
    # would wait for a lease or the 30 s waiter deadline (409 or a client timeout)
    # instead of running the handler at once; and a response stored or an order
    # inserted for the execution that was killed.
    latency = 3.0
    server = demo.start(
        limit=BIG_LIMIT, window=60, workers=WORKERS, checkout_latency=latency, worker_header=True
    )
    wait_for_all_workers(server)
    body = order("lamp", 7)
    key = "k-killed"

    with socket.create_connection((LOCAL, server.port), timeout=CLIENT_TIMEOUT) as sock:
        client_port: int = sock.getsockname()[1]
        send_request(sock, "GET", "/health", {})
        status, headers, _ = read_response(sock)
        assert status == 200
        # Which worker accepted this connection, from /proc, cross-checked with the header.
        victim = socket_holder(server, client_port)
        assert victim is not None, f"no worker holds the connection from port {client_port}"
        assert victim == int(headers["x-demo-worker"]), (victim, headers)

        send_request(sock, "POST", "/orders", keyed(key), body)
        wait_until(lambda: sqlite_claims(server.db_path) == 1, "inside the checkout: owned")
        assert socket_holder(server, client_port) == victim
        assert order_rows(server) == []
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        sock.settimeout(5.0)
        try:
            leftover = sock.recv(65536)
        except ConnectionResetError:
            leftover = b""
        assert leftover == b"", f"the killed checkout answered: {leftover!r}"
    assert order_rows(server) == [], "the killed worker inserted its order"

    async def retry() -> httpx.Response:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return await fresh_request(
                    server, "POST", "/orders", content=body, headers=keyed(key)
                )
            except httpx.TimeoutException:
                pytest.fail(
                    f"the retry got no answer in {CLIENT_TIMEOUT} s: the key stayed owned"
                    f" after its owner (worker {victim}) was killed"
                )
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                # Only connection-level failures around the kill are retried.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    response = asyncio.run(retry())
    elapsed = time.monotonic() - killed_at
    taker = worker_of(response)
    live = worker_pids(server)
    print(
        f"\nleg 4: killed worker {victim}; retry served by {taker} in {elapsed:.2f} s;"
        f" live workers now {sorted(live)}"
    )
    assert response.status_code == 201, response.text
    assert not is_replay(response), "the retry replayed: someone stored the killed execution"
    assert taker != victim
    assert taker in live, f"{taker} is not a live worker ({sorted(live)})"
    assert elapsed < 6.0, f"the key was held {elapsed:.2f} s after its owner died"
    assert elapsed >= latency - 0.2, f"{elapsed:.2f} s: the retry did not run the checkout"
    assert order_rows(server) == [(1, "lamp", 7)]

    later = asyncio.run(fresh_request(server, "POST", "/orders", content=body, headers=keyed(key)))
    assert later.status_code == 201, later.text
    assert is_replay(later)
    assert later.content == response.content
    assert order_rows(server) == [(1, "lamp", 7)]


# -- 5. waiters parked across workers cost no CPU ---------------------------------------------


def test_parked_waiters_across_workers_cost_no_cpu(demo: DemoLauncher) -> None:
    # Catches: waiters that poll (retrying the key lock, or re-reading the store, in a
    # loop) or spin while another worker owns the key: ~30 of them in four processes
    # would burn measurable CPU during the owner's 4 s checkout. Also catches waiters
    # answered before the owner finished (a duplicate done before the owner), and
    # several executions.
    latency = 4.0
    server = demo.start(
        limit=BIG_LIMIT, window=60, workers=WORKERS, checkout_latency=latency, worker_header=True
    )
    wait_for_all_workers(server)
    body = order("tea", 5)
    headers = keyed("k-parked")
    tick = 1 / os.sysconf("SC_CLK_TCK")

    @dataclass(slots=True)
    class Sample:
        conns: list[Conn]
        owner: httpx.Response
        duplicates: list[httpx.Response]
        cpu: float
        parked_at_end: int
        elapsed: float

    async def run() -> Sample:
        async with contextlib.AsyncExitStack() as stack:
            conns = await open_spread(stack, server, 31, bound=60)
            workers = worker_pids(server)
            started = time.monotonic()
            owner_task = asyncio.create_task(
                conns[0].http.post("/orders", content=body, headers=headers)
            )
            await asyncio.to_thread(
                wait_until, lambda: sqlite_claims(server.db_path) == 1, "the owner holds it", 20.0
            )
            dup_tasks = [
                asyncio.create_task(c.http.post("/orders", content=body, headers=headers))
                for c in conns[1:]
            ]
            # Every duplicate parked (the workers' porch_parked_waiters gauges), well
            # before the owner ends at ~4 s.
            await asyncio.to_thread(
                wait_until,
                lambda: parked_waiters(server) == len(dup_tasks),
                "every duplicate parked",
                20.0,
            )
            assert not owner_task.done()
            assert not any(t.done() for t in dup_tasks), "a duplicate was answered early"
            before = {pid: cpu_seconds(pid) for pid in workers}
            await asyncio.sleep(2.0)
            after = {pid: cpu_seconds(pid) for pid in workers}
            parked = sum(not t.done() for t in dup_tasks)
            owner = await owner_task
            duplicates = list(await asyncio.gather(*dup_tasks))
            return Sample(
                conns,
                owner,
                duplicates,
                sum(after[pid] - before[pid] for pid in workers),
                parked,
                time.monotonic() - started,
            )

    sample = asyncio.run(run())
    responses = [sample.owner, *sample.duplicates]
    workers = spread(responses)
    print(
        f"\nleg 5: {len(sample.duplicates)} duplicates parked behind worker"
        f" {worker_of(sample.owner)}; responses by worker {dict(workers)};"
        f" worker CPU over 2 s: {sample.cpu:.3f} s (tick {tick:.3f} s);"
        f" total {sample.elapsed:.2f} s"
    )
    assert sample.parked_at_end == len(sample.duplicates), "duplicates answered mid-checkout"
    assert sample.cpu < 0.1, f"parked waiters burnt {sample.cpu:.3f} s of CPU in 2 s"
    assert [r.status_code for r in responses] == [201] * len(responses), [
        (r.status_code, r.text) for r in responses
    ]
    assert len({r.content for r in responses}) == 1, "duplicates got different bodies"
    assert not is_replay(sample.owner), "the first request did not run the checkout"
    assert all(is_replay(r) for r in sample.duplicates), "a duplicate ran the checkout"
    assert order_rows(server) == [(1, "tea", 5)]
    others = {worker_of(r) for r in sample.duplicates} - {worker_of(sample.owner)}
    assert others, f"no duplicate waited in another worker than the owner's: {workers}"
    assert sample.elapsed < latency + 1.5, f"{sample.elapsed:.2f} s for one {latency} s checkout"
