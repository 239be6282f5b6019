"""The idempotency gate: DESIGN.md's criteria 6-9 against real server processes.

Every leg talks HTTP over real loopback sockets to a real server process: the
``porch demo`` storefront (``POST /orders`` honours ``Idempotency-Key``), or,
for handlers that fail, ``app_flaky`` (a tiny Starlette app behind porch's
``IdempotencyMiddleware``) under uvicorn. Executions are counted from rows (the
demo's ``orders`` table, the flaky app's ``executions`` table) and stored
responses are read from porch's ``responses`` table, never from logs. Each leg
says in a comment which broken mechanism it would catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_flaky import DATA_ENV, EXECUTIONS_FILE, STORE_ENV
from demo_server import (
    DemoLauncher,
    launch_demos,
    order_rows,
    orders_count,
    read_response,
    source_port,
)

from servers import free_port, running_postgres, running_redis
from support import sqlite_claims

pytestmark = [pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
PROBLEM_JSON = "application/problem+json"
REPLAYED = "Idempotent-Replayed"
ANON = "client:127.0.0.1"  # CallerScope: no credentials, so the client identity
SEP = "\x1f"
BIG_LIMIT = 10000  # keeps the demo's rate limiter out of the way
STARTUP_TIMEOUT = 15.0
CLIENT_TIMEOUT = 15.0  # under the 30 s waiter deadline (a stranded waiter fails fast)

Headers = Sequence[tuple[str, str | bytes]]


def raw_headers(headers: Headers) -> list[tuple[bytes, bytes]]:
    """Header lines as sent: str values as Latin-1, bytes values as they are."""
    return [
        (name.encode("ascii"), value if isinstance(value, bytes) else value.encode("latin-1"))
        for name, value in headers
    ]


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    """Starts demo servers; every one still running at teardown is killed."""
    with launch_demos(tmp_path) as launcher:
        yield launcher


def _read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)


def _query(path: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows of a read-only query; no file yet means no rows."""
    if not path.exists():
        return []
    conn = _read_only(path)
    try:
        return [tuple(row) for row in conn.execute(sql, params).fetchall()]
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        conn.close()


@dataclass(frozen=True, slots=True)
class StoredRow:
    """One row of porch's ``responses`` table."""

    key: str
    digest: bytes
    status: int
    headers: list[list[str]]
    body: bytes


def stored(db_path: Path) -> dict[str, StoredRow]:
    """Porch's stored responses, by scoped key."""
    rows = _query(db_path, "SELECT key, digest, status, headers, body FROM responses")
    return {
        str(key): StoredRow(str(key), bytes(digest), int(status), json.loads(headers), bytes(body))
        for key, digest, status, headers, body in rows
    }


def anon(key: str) -> str:
    """The scoped key porch stores for a request from 127.0.0.1 without credentials."""
    return f"{ANON}{SEP}{key}"


def order(item: str = "tea", qty: int = 1) -> bytes:
    return json.dumps({"item": item, "qty": qty}, separators=(",", ":")).encode()


def keyed(key: str | bytes, *extra: tuple[str, str | bytes]) -> list[tuple[str, str | bytes]]:
    return [("Content-Type", "application/json"), ("Idempotency-Key", key), *extra]


def post(
    base_url: str,
    path: str,
    body: bytes,
    headers: Headers = (),
    *,
    timeout: float = CLIENT_TIMEOUT,
) -> httpx.Response:
    """One POST on a brand-new connection."""
    with httpx.Client(base_url=base_url, timeout=timeout, trust_env=False) as http:
        return http.post(path, content=body, headers=raw_headers(headers))


def timed_post(
    base_url: str, path: str, body: bytes, headers: Headers = ()
) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = post(base_url, path, body, headers)
    return response, time.monotonic() - start


@dataclass(frozen=True, slots=True)
class Volley:
    """Requests fired at once: the responses (in request order), wall time, source ports."""

    responses: list[httpx.Response]
    elapsed: float
    ports: set[int]


async def _post_streamed(
    http: httpx.AsyncClient, path: str, body: bytes, headers: Headers
) -> tuple[httpx.Response, int]:
    # The source port is read as soon as the head arrives, while the socket is surely
    # open (a server that closes after a 500 would otherwise leave nothing to read).
    async with http.stream("POST", path, content=body, headers=raw_headers(headers)) as response:
        port = source_port(response)
        await response.aread()
    return response, port


async def _volley(
    base_url: str, requests: Sequence[tuple[str, bytes, Headers]], client_timeout: float
) -> Volley:
    async with contextlib.AsyncExitStack() as stack:
        # One client (one connection) per request, opened first on /health (unkeyed, and
        # exempt from the demo's limiter): the volley leaves at once over n sockets.
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=base_url,
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                    timeout=client_timeout,
                    trust_env=False,
                )
            )
            for _ in requests
        ]
        warm = await asyncio.gather(*(http.get("/health") for http in clients))
        assert all(r.status_code == 200 for r in warm)
        start = time.monotonic()
        results = await asyncio.gather(
            *(
                _post_streamed(http, path, body, headers)
                for http, (path, body, headers) in zip(clients, requests, strict=True)
            )
        )
        elapsed = time.monotonic() - start
    return Volley([r for r, _ in results], elapsed, {port for _, port in results})


def volley(
    base_url: str,
    requests: Sequence[tuple[str, bytes, Headers]],
    *,
    timeout: float = CLIENT_TIMEOUT,
) -> Volley:
    """Fire every request at the same moment, each on its own connection."""
    result = asyncio.run(_volley(base_url, requests, timeout))
    assert len(result.ports) == len(requests), "the volley shared connections"
    return result


def is_replay(response: httpx.Response) -> bool:
    values: list[str] = response.headers.get_list(REPLAYED)
    assert values in ([], ["true"]), f"{REPLAYED}: {values!r}"
    return bool(values)


def check_replay(replay: httpx.Response, first: httpx.Response) -> None:
    """``replay`` is ``first`` replayed: same status and bytes, marked as a replay."""
    assert replay.status_code == first.status_code, replay.text
    assert replay.content == first.content, (replay.content, first.content)
    assert replay.headers.get("Content-Type") == first.headers.get("Content-Type")
    assert is_replay(replay), f"a replay without {REPLAYED}: {dict(replay.headers)}"
    # Never a stored Set-Cookie, and exactly one Date (the server's own, never a stored one).
    assert "set-cookie" not in replay.headers
    assert len(replay.headers.get_list("date")) <= 1


def check_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["Content-Type"].split(";")[0] == PROBLEM_JSON
    body: dict[str, Any] = response.json()
    assert body["status"] == status, body
    assert isinstance(body["title"], str)
    assert isinstance(body["detail"], str)
    assert not is_replay(response)
    return body


def wait_until(predicate: Any, what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` (bounded) until it holds; the store commits just after a response."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# -- the flaky app: handlers that fail, as a real uvicorn process ---------------------------


class FlakyServer:
    """``tests/e2e/app_flaky.py`` under uvicorn on a free loopback port.

    ``store``: a store URL shared with other hosts (default: SQLite in its data
    directory); ``data``: a data directory shared with them (executions are counted
    together)."""

    def __init__(self, root: Path, *, store: str | None = None, data: Path | None = None) -> None:
        self.data_dir = data or root / "data"
        self.log = root / "server.log"
        self.store = store
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "porch.sqlite3"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def start(self) -> None:
        env = dict(os.environ)
        env[DATA_ENV] = str(self.data_dir)
        if self.store is not None:
            env[STORE_ENV] = self.store
        env["PYTHONUNBUFFERED"] = "1"
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "app_flaky:create_app",
            "--factory",
            "--app-dir",
            str(HERE),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--no-access-log",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with httpx.Client(timeout=1.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"app_flaky exited with {self.proc.returncode}\n{self.output()}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"app_flaky did not answer within {STARTUP_TIMEOUT} s\n{self.output()}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)

    def executions(self, route: str, tag: str) -> int:
        """How many times the handler of ``route`` ran for ``tag``, from its rows."""
        rows = _query(
            self.data_dir / EXECUTIONS_FILE,
            "SELECT COUNT(*) FROM executions WHERE route = ? AND tag = ?",
            (route, tag),
        )
        return int(rows[0][0]) if rows else 0

    def stored(self) -> dict[str, StoredRow]:
        return stored(self.db_path)


@pytest.fixture(scope="module")
def flaky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlakyServer]:
    """One flaky server for the failing-handler legs (each leg uses its own keys and tags)."""
    server = FlakyServer(tmp_path_factory.mktemp("flaky"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tagged(tag: str) -> bytes:
    return json.dumps({"tag": tag}).encode()


# -- 6. a replayed key returns the stored response byte-identically --------------------------


def test_replay_is_byte_identical_and_runs_nothing(demo: DemoLauncher) -> None:
    # Catches: no stored response (the handler runs again: a second order row and a new
    # id), a replay rebuilt instead of stored (bytes differ), a replay not marked
    # Idempotent-Replayed (or a first execution marked as one), and a 4xx not stored.
    server = demo.start(limit=BIG_LIMIT, window=60)
    first = post(server.base_url, "/orders", order("lamp", 2), keyed("order-6"))
    assert first.status_code == 201, first.text
    assert not is_replay(first), "the first execution was marked as a replay"
    assert first.json() == {"id": 1, "item": "lamp", "qty": 2}
    assert order_rows(server) == [(1, "lamp", 2)]

    for _ in range(3):
        replay = post(server.base_url, "/orders", order("lamp", 2), keyed("order-6"))
        check_replay(replay, first)
    assert order_rows(server) == [(1, "lamp", 2)], "a replay ran the handler"
    with httpx.Client(base_url=server.base_url, trust_env=False) as http:
        listing = http.get("/orders").json()
    assert listing["count"] == 1

    # What is stored is exactly what was sent: status, bytes and the allow-listed headers.
    rows = stored(server.db_path)
    assert list(rows) == [anon("order-6")]
    row = rows[anon("order-6")]
    assert row.status == 201
    assert row.body == first.content
    assert {name for name, _ in row.headers} <= {
        "content-type",
        "location",
        "etag",
        "content-location",
    }, row.headers
    assert ["content-type", "application/json"] in row.headers

    # A 400 is stored as well: a malformed body under a key replays its 400, unrun.
    bad = post(server.base_url, "/orders", b"{not json", keyed("order-6-bad"))
    assert bad.status_code == 400, bad.text
    assert not is_replay(bad)
    wait_until(lambda: anon("order-6-bad") in stored(server.db_path), "the stored 400")
    for _ in range(2):
        check_replay(post(server.base_url, "/orders", b"{not json", keyed("order-6-bad")), bad)
    assert orders_count(server) == 1


# -- 7. a reused key with a different request is refused: 422, handler not run ---------------


def test_reserialised_json_is_a_replay(demo: DemoLauncher) -> None:
    # Catches: a digest over the body's bytes where the demo promises JSON (issue 29): a
    # client that re-serialises its order on retry got 422 and no order.
    server = demo.start(limit=BIG_LIMIT, window=60)
    first = post(server.base_url, "/orders", order("chair", 2), keyed("json-1"))
    assert first.status_code == 201, first.text
    for other in [
        b'{"qty": 2, "item": "chair"}',
        b'{\n  "item" : "chair",\n  "qty" : 2\n}\n',
        b'{"item":"\\u0063hair","qty":2.0}',
    ]:
        check_replay(post(server.base_url, "/orders", other, keyed("json-1")), first)
    check_problem(post(server.base_url, "/orders", order("chair", 3), keyed("json-1")), 422)
    assert orders_count(server) == 1


def test_reused_key_with_different_request_is_refused(demo: DemoLauncher) -> None:
    # Catches: a digest that is not compared (a replay of the wrong response, or a second
    # execution), a digest that leaves out the query string, a JSON comparison that lets
    # another value or a body that is no JSON through, and a refusal that overwrites or
    # deletes the stored response. (The demo compares orders as JSON: a re-serialised
    # order is a replay, test_reserialised_json_is_a_replay.)
    server = demo.start(limit=BIG_LIMIT, window=60)
    body = order("chair", 1)
    first = post(server.base_url, "/orders", body, keyed("order-7"))
    assert first.status_code == 201, first.text
    wait_until(lambda: anon("order-7") in stored(server.db_path), "the stored 201")
    before = stored(server.db_path)[anon("order-7")]

    different = [
        ("/orders", order("chair", 2)),  # another quantity
        ("/orders", order("lamp", 1)),  # another item
        ("/orders", b'{"item": "chair", "qty": "1"}'),  # a string is not a number
        ("/orders", b'{"item": "chair", "qty": 1, "qty": 1}'),  # a repeated key: bytes
        ("/orders?coupon=1", body),  # same body, another query string
        ("/orders?", body + b"x"),  # trailing byte: no JSON any more
    ]
    for path, other in different:
        refused = post(server.base_url, path, other, keyed("order-7"))
        check_problem(refused, 422)
        assert orders_count(server) == 1, f"{path} {other!r} ran the handler"

    after = stored(server.db_path)
    assert list(after) == [anon("order-7")]
    assert after[anon("order-7")] == before, "a refusal changed the stored response"
    # The original request still replays its own response.
    check_replay(post(server.base_url, "/orders", body, keyed("order-7")), first)
    assert orders_count(server) == 1


# -- 8. concurrent duplicates: exactly one executes, the others get its response -------------


def test_concurrent_duplicates_execute_once(demo: DemoLauncher) -> None:
    # Catches: no per-key ownership (several executions: several rows), duplicates
    # refused (409/422) instead of parked, waiters polling or sleeping (wall time far
    # above one checkout), and waiters answered before the owner's response was stored.
    server = demo.start(limit=BIG_LIMIT, window=60, checkout_latency=1.0)
    n = 8
    body = order("tea", 3)
    result = volley(server.base_url, [("/orders", body, keyed("order-8"))] * n)
    codes = Counter(r.status_code for r in result.responses)
    assert codes == Counter({201: n}), [(r.status_code, r.text) for r in result.responses]
    assert len({r.content for r in result.responses}) == 1, "duplicates got different bodies"
    owners = [r for r in result.responses if not is_replay(r)]
    assert len(owners) == 1, f"{len(owners)} responses were not replays"
    assert order_rows(server) == [(1, "tea", 3)], "the handler ran more than once"
    assert result.elapsed < 1.8, f"{n} duplicates took {result.elapsed:.2f} s (one checkout: 1 s)"
    # The waiters' response is the stored one.
    row = stored(server.db_path)[anon("order-8")]
    assert row.body == owners[0].content


# -- stored responses survive SIGTERM + restart and kill -9 + restart ------------------------


def test_stored_replay_survives_restarts(demo: DemoLauncher) -> None:
    # Catches: stored responses kept in memory only, or not committed durably before
    # a reply (a replay after the replay-confirmed commit missing after kill -9), and a
    # restart that rebases expiry so the stored response is lost.
    server = demo.start(limit=BIG_LIMIT, window=60)
    body = order("chair", 4)
    first = post(server.base_url, "/orders", body, keyed("order-restart"))
    assert first.status_code == 201, first.text
    # A replay proves the response is committed before we stop the process (see the
    # report on the owner's response leaving before its commit).
    check_replay(post(server.base_url, "/orders", body, keyed("order-restart")), first)

    server.terminate()
    server.restart()
    check_replay(post(server.base_url, "/orders", body, keyed("order-restart")), first)
    check_problem(post(server.base_url, "/orders", order("chair", 5), keyed("order-restart")), 422)
    assert orders_count(server) == 1

    server.kill()
    server.restart()
    check_replay(post(server.base_url, "/orders", body, keyed("order-restart")), first)
    assert orders_count(server) == 1
    assert list(stored(server.db_path)) == [anon("order-restart")]


# -- a crash mid-handler loses only in-memory ownership --------------------------------------


@pytest.mark.slow
def test_kill_mid_checkout_does_not_wedge_the_key(demo: DemoLauncher) -> None:
    # Catches: a durable "pending" marker or lease (after the restart the key is wedged:
    # 409, or a wait until a lease expires), and a response stored for an execution
    # that never finished.
    server = demo.start(limit=BIG_LIMIT, window=60, checkout_latency=3)
    body = order("lamp", 7)
    outcome: list[httpx.Response | BaseException] = []

    def in_flight() -> None:
        try:
            outcome.append(post(server.base_url, "/orders", body, keyed("order-crash")))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=in_flight, daemon=True)
    thread.start()
    wait_until(lambda: sqlite_claims(server.db_path) == 1, "inside the checkout: owner taken")
    assert orders_count(server) == 0
    server.kill()
    thread.join(timeout=10.0)
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], httpx.HTTPError), f"the killed request answered: {outcome[0]}"
    assert stored(server.db_path) == {}, "a response was stored for an unfinished execution"

    server.restart()
    response, elapsed = timed_post(server.base_url, "/orders", body, keyed("order-crash"))
    assert response.status_code == 201, response.text
    assert not is_replay(response)
    assert elapsed < 6.0, f"the key was wedged: {elapsed:.2f} s"
    assert elapsed >= 2.5, f"{elapsed:.2f} s: the handler (3 s checkout) did not run"
    assert order_rows(server) == [(1, "lamp", 7)]
    check_replay(post(server.base_url, "/orders", body, keyed("order-crash")), response)
    assert orders_count(server) == 1


def raw_post(port: int, path: str, body: bytes, key: str) -> tuple[int, bytes]:
    """POST over a plain socket; return (status, body) the instant the response is complete."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode("ascii")
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT) as sock:
        sock.sendall(head + body)
        status, _, content = read_response(sock)
        return status, content


def test_owner_response_is_stored_before_it_leaves(demo: DemoLauncher) -> None:
    # DESIGN.md: "No response ever leaves for a request whose count or stored response is
    # not yet durable." Catches: the owner's response reaching the client before its
    # stored copy is committed. kill -9 the instant the 201 is complete; after the
    # restart the same keyed request must be a replay, never a second execution (a
    # double charge).
    server = demo.start(limit=BIG_LIMIT, window=60)
    body = order("chair", 9)
    for trial in range(3):
        key = f"durable-{trial}"
        status, content = raw_post(server.port, "/orders", body, key)
        server.kill()
        assert status == 201, content
        server.restart()
        retry = post(server.base_url, "/orders", body, keyed(key))
        assert retry.status_code == 201, retry.text
        assert is_replay(retry), (
            f"trial {trial}: the client got {content!r}, yet after kill -9 the retry ran the"
            f" handler again: {retry.content!r}; orders rows: {order_rows(server)}"
        )
        assert retry.content == content
        assert orders_count(server) == trial + 1


# -- failing handlers: 5xx and exceptions are never stored -----------------------------------


def test_5xx_once_then_success_is_retried_then_stored(flaky: FlakyServer) -> None:
    # Catches: a stored 5xx (the retry would replay the 500 and never run again).
    key, tag = "flaky-a", "a"
    failed = post(flaky.base_url, "/flaky", tagged(tag), keyed(key))
    assert failed.status_code == 500, failed.text
    assert not is_replay(failed)
    assert flaky.executions("flaky", tag) == 1
    assert anon(key) not in flaky.stored()

    retried = post(flaky.base_url, "/flaky", tagged(tag), keyed(key))
    assert retried.status_code == 201, retried.text
    assert not is_replay(retried)
    assert retried.json() == {"tag": tag, "execution": 2}
    assert flaky.executions("flaky", tag) == 2

    check_replay(post(flaky.base_url, "/flaky", tagged(tag), keyed(key)), retried)
    assert flaky.executions("flaky", tag) == 2
    assert flaky.stored()[anon(key)].status == 201


def test_waiters_of_a_failed_owner_do_not_inherit_its_failure(flaky: FlakyServer) -> None:
    # Catches: waiters handed the owner's 500 (three 500s), waiters all running after
    # the failure (three executions), and waiters stranded until their deadline (the
    # failed owner never reported: client timeouts or 409s).
    key, tag = "flaky-b", "b"
    latency = 0.5
    result = volley(flaky.base_url, [(f"/flaky?latency={latency}", tagged(tag), keyed(key))] * 3)
    codes = sorted(r.status_code for r in result.responses)
    assert codes == [201, 201, 500], [(r.status_code, r.text) for r in result.responses]
    (failed,) = [r for r in result.responses if r.status_code == 500]
    assert not is_replay(failed)
    successes = [r for r in result.responses if r.status_code == 201]
    assert successes[0].content == successes[1].content
    assert successes[0].json() == {"tag": tag, "execution": 2}
    assert sorted(is_replay(r) for r in successes) == [False, True]
    assert flaky.executions("flaky", tag) == 2
    # Two handler runs back to back, no deadline in between.
    assert result.elapsed < 2 * latency + 1.5, f"{result.elapsed:.2f} s"
    assert flaky.stored()[anon(key)].status == 201


def test_always_failing_handler_leaves_no_stored_key(flaky: FlakyServer) -> None:
    # Catches: a stored 5xx (executions stay at 1) or a key left behind by failures.
    key, tag = "flaky-c", "c"
    bodies = set()
    for attempt in range(1, 4):
        response = post(flaky.base_url, "/always-fails", tagged(tag), keyed(key))
        assert response.status_code == 500, response.text
        assert not is_replay(response)
        assert response.json()["execution"] == attempt
        bodies.add(response.content)
    assert len(bodies) == 3, "a 500 was replayed"
    assert flaky.executions("always-fails", tag) == 3
    assert anon(key) not in flaky.stored()


def test_raising_handler_stores_nothing_and_is_retried(flaky: FlakyServer) -> None:
    # Catches: a raised exception that skips the owner's report (the key stays owned:
    # the retry parks until the 30 s deadline and gets a 409), and a stored failure.
    key, tag = "flaky-d", "d"
    for attempt in range(1, 3):
        response = post(flaky.base_url, "/raises", tagged(tag), keyed(key))
        assert response.status_code == 500, response.text
        assert not is_replay(response)
        assert flaky.executions("raises", tag) == attempt
    assert anon(key) not in flaky.stored()

    # Duplicates parked behind an owner that raises: each is promoted in turn, promptly.
    key, tag = "flaky-d-concurrent", "d2"
    latency = 0.3
    result = volley(flaky.base_url, [(f"/raises?latency={latency}", tagged(tag), keyed(key))] * 3)
    assert [r.status_code for r in result.responses] == [500] * 3
    assert not any(is_replay(r) for r in result.responses)
    assert flaky.executions("raises", tag) == 3
    assert result.elapsed < 3 * latency + 2.0, f"{result.elapsed:.2f} s"
    assert anon(key) not in flaky.stored()
    # And the server is still healthy: a working route under a fresh key runs and stores.
    ok = post(flaky.base_url, "/ok", tagged("d3"), keyed("flaky-d-ok"))
    assert ok.status_code == 201, ok.text
    check_replay(post(flaky.base_url, "/ok", tagged("d3"), keyed("flaky-d-ok")), ok)
    assert flaky.executions("ok", "d3") == 1


# -- an owner whose event loop is blocked, on a store shared by two hosts --------------------

NETWORK_STORES = [
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]
Lease = Callable[[], tuple[float | None, float]]


def _postgres_lease(url: str) -> tuple[float | None, float]:
    """The held claim's lease end (None: none held) and the server's time, in its seconds."""
    import asyncpg

    async def read() -> tuple[float | None, float]:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            end, now = await conn.fetchrow(
                "SELECT (SELECT max(lease_until) FROM porch.records"
                " WHERE status IS NULL AND lease_until IS NOT NULL),"
                " extract(epoch FROM clock_timestamp())::float8"
            )
        finally:
            await conn.close()
        return end, now

    return asyncio.run(read())


def _redis_lease(url: str) -> tuple[float | None, float]:
    """The held claim's lease end (None: none held) and the server's time, in its seconds."""
    import redis

    conn = redis.Redis.from_url(url, socket_timeout=10)
    try:
        fields = [conn.hmget(key, "o", "l") for key in conn.scan_iter(match="porch:r:*")]
        seconds, micros = conn.time()
    finally:
        conn.close()
    ends = [int(end) / 1000 for owner, end in fields if owner not in (None, b"0") and end]
    return (max(ends) if ends else None), seconds + micros / 1e6


@contextlib.contextmanager
def two_hosts_on(tmp_path: Path, backend: str) -> Iterator[tuple[FlakyServer, FlakyServer, Lease]]:
    """Two flaky hosts on one server of the leg's own (default lease: 3 s), sharing their
    executions' data directory; and a reader of the one claim's lease in the store."""
    opened = running_postgres() if backend == "postgres" else running_redis()
    with opened as server:
        url = server.url
        hosts: list[FlakyServer] = []
        try:
            for name in ("a", "b"):
                (tmp_path / name).mkdir()
                hosts.append(FlakyServer(tmp_path / name, store=url, data=tmp_path / "data"))
                hosts[-1].start()
            read = _postgres_lease if backend == "postgres" else _redis_lease
            yield hosts[0], hosts[1], functools.partial(read, url)
        finally:
            for host in hosts:
                host.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", NETWORK_STORES)
def test_an_owner_blocking_its_event_loop_past_the_lease_runs_once(
    tmp_path: Path, backend: str
) -> None:
    # Catches: leases renewed on the owner's event loop only. Synchronous work in an
    # ``async def`` handler blocks that loop past the 3 s lease; the lease lapsed, and a
    # duplicate sent to the other host meanwhile ran the handler a second time.
    path, tag = "/ok?block=6", "blocked"
    keyed_raw = raw_headers(keyed(tag))
    with two_hosts_on(tmp_path, backend) as (a, b, lease):

        async def run() -> tuple[httpx.Response, httpx.Response, tuple[float | None, float]]:
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
                owner = asyncio.create_task(
                    client.post(a.base_url + path, content=tagged(tag), headers=keyed_raw)
                )
                await asyncio.to_thread(
                    wait_until, lambda: a.executions("ok", tag) == 1, "a's handler", 20.0
                )
                before, _ = await asyncio.to_thread(lease)
                assert before is not None, "a holds no claim while its handler runs"
                # Past the end of the lease a held as its loop blocked, on the store's clock.
                await asyncio.to_thread(
                    wait_until, lambda: lease()[1] > before + 0.2, "that lease's end", 10.0
                )
                during = await asyncio.to_thread(lease)
                assert not owner.done(), "the handler no longer blocks: the leg proves nothing"
                duplicate = await client.post(
                    b.base_url + path, content=tagged(tag), headers=keyed_raw
                )
                return await owner, duplicate, during

        first, duplicate, (end, now) = asyncio.run(run())
        assert a.executions("ok", tag) == 1  # both hosts' executions, from rows
        assert first.status_code == 201, first.text
        assert not is_replay(first)
        check_replay(duplicate, first)
        # The claim was renewed while the loop was blocked (from outside it).
        assert end is not None
        assert end > now


@pytest.mark.slow
@pytest.mark.parametrize("backend", NETWORK_STORES)
def test_a_frozen_owner_still_loses_its_key_within_the_lease(tmp_path: Path, backend: str) -> None:
    # Catches: a lease kept by something that outlives a frozen process (the heartbeat
    # thread must stop with it): the duplicate would wait for good and never run.
    path, tag = "/ok?block=1", "frozen"
    with two_hosts_on(tmp_path, backend) as (a, b, _):
        assert a.proc is not None
        pid = a.proc.pid

        async def run() -> tuple[httpx.Response, httpx.Response, float]:
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
                owner = asyncio.create_task(
                    client.post(
                        a.base_url + path, content=tagged(tag), headers=raw_headers(keyed(tag))
                    )
                )
                await asyncio.to_thread(
                    wait_until, lambda: a.executions("ok", tag) == 1, "a's handler", 20.0
                )
                os.kill(pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    taker = await client.post(
                        b.base_url + path, content=tagged(tag), headers=raw_headers(keyed(tag))
                    )
                    took = time.monotonic() - started
                finally:
                    os.kill(pid, signal.SIGCONT)
                return await owner, taker, took

        first, taker, took = asyncio.run(run())
        assert taker.status_code == 201, taker.text
        assert not is_replay(taker)
        assert took < 3.0 + 1.0 + 3.0, took  # the lease, the taker's own run, slack
        assert a.executions("ok", tag) == 2
        assert first.status_code == 201  # the thawed owner answers its own client
        assert first.content != taker.content
        # Its save was fenced: both hosts replay the taker's response.
        for host in (a, b):
            check_replay(post(host.base_url, path, tagged(tag), keyed(tag)), taker)
        assert a.executions("ok", tag) == 2


# -- keys are scoped to the caller -----------------------------------------------------------


def test_keys_are_scoped_to_the_caller(demo: DemoLauncher) -> None:
    # Catches: an unscoped lookup key (bob would get alice's order, or a 422 for his own
    # different body: one caller could replay or probe another's key).
    server = demo.start(limit=BIG_LIMIT, window=60)
    callers: Mapping[str, tuple[Headers, bytes]] = {
        "alice": ([("Authorization", "Bearer alice")], order("tea", 1)),
        "bob": ([("Authorization", "Bearer bob")], order("chair", 2)),
        "anonymous": ([], order("lamp", 3)),
    }
    firsts: dict[str, httpx.Response] = {}
    for name, (auth, body) in callers.items():
        response = post(server.base_url, "/orders", body, keyed("shared-key", *auth))
        assert response.status_code == 201, (name, response.text)
        assert not is_replay(response), f"{name} got another caller's response"
        firsts[name] = response
    assert sorted(item for _, item, _ in order_rows(server)) == ["chair", "lamp", "tea"]
    assert len({r.json()["id"] for r in firsts.values()}) == 3

    for name, (auth, body) in callers.items():
        check_replay(
            post(server.base_url, "/orders", body, keyed("shared-key", *auth)), firsts[name]
        )
    assert orders_count(server) == 3

    # Alice sending bob's request under the shared key is refused, not shown bob's order.
    bob_body = callers["bob"][1]
    check_problem(
        post(
            server.base_url,
            "/orders",
            bob_body,
            keyed("shared-key", ("Authorization", "Bearer alice")),
        ),
        422,
    )
    assert orders_count(server) == 3

    keys = sorted(stored(server.db_path))
    assert len(keys) == 3
    assert all(k.endswith(SEP + "shared-key") for k in keys), keys
    assert anon("shared-key") in keys
    assert len({k.split(SEP)[0] for k in keys}) == 3


# -- malformed keys are a clear 400, never a run ---------------------------------------------


INVALID_KEYS: list[tuple[str, list[tuple[str, str | bytes]]]] = [
    ("empty", [("Idempotency-Key", "")]),
    ("empty quoted", [("Idempotency-Key", '""')]),
    ("256 characters", [("Idempotency-Key", "k" * 256)]),
    ("256 characters quoted", [("Idempotency-Key", '"' + "k" * 256 + '"')]),
    ("tab inside", [("Idempotency-Key", "a\tb")]),
    ("non-ASCII bytes", [("Idempotency-Key", b"caf\xc3\xa9")]),
    ("non-ASCII quoted", [("Idempotency-Key", b'"caf\xc3\xa9"')]),
    ("two header lines", [("Idempotency-Key", "one"), ("Idempotency-Key", "two")]),
    ("two header lines, same value", [("Idempotency-Key", "same"), ("Idempotency-Key", "same")]),
    ("bare value with a comma", [("Idempotency-Key", "a,b")]),
    ("two quoted values", [("Idempotency-Key", '"a", "b"')]),
    ("text after the string", [("Idempotency-Key", '"a"b')]),
    ("unterminated quote", [("Idempotency-Key", '"abc')]),
    ("bad escape", [("Idempotency-Key", '"a\\nb"')]),
    ("dangling backslash", [("Idempotency-Key", '"abc\\"')]),
]


def test_invalid_keys_are_refused_and_run_nothing(demo: DemoLauncher) -> None:
    # Catches: a lax parser (junk keys accepted: a 201 and a new row, or a stored key),
    # a parser that crashes (500), and the header made mandatory by mistake.
    # (DEL and other control bytes never reach porch: uvicorn's parser refuses them.)
    server = demo.start(limit=BIG_LIMIT, window=60)
    body = order("tea", 1)
    for name, headers in INVALID_KEYS:
        response = post(
            server.base_url, "/orders", body, [("Content-Type", "application/json"), *headers]
        )
        problem = check_problem(response, 400)
        assert "Idempotency-Key" in problem["detail"], (name, problem)
        assert orders_count(server) == 0, f"{name}: the handler ran"
    assert stored(server.db_path) == {}

    # Without the header the request passes through, unkeyed: it runs every time.
    for expected in (1, 2):
        plain = post(server.base_url, "/orders", body, [("Content-Type", "application/json")])
        assert plain.status_code == 201, plain.text
        assert not is_replay(plain)
        assert orders_count(server) == expected
    assert stored(server.db_path) == {}

    # The edges that are valid: 255 characters, and a quoted string with escapes, stored
    # under its decoded value (so the bare spelling of the same key replays it).
    longest = "k" * 255
    at_limit = post(server.base_url, "/orders", body, keyed(longest))
    assert at_limit.status_code == 201, at_limit.text
    quoted = post(server.base_url, "/orders", body, keyed('"say \\"hi\\" \\\\o/"'))
    assert quoted.status_code == 201, quoted.text
    assert orders_count(server) == 4
    keys = set(stored(server.db_path))
    assert keys == {anon(longest), anon('say "hi" \\o/')}, keys
    check_replay(post(server.base_url, "/orders", body, keyed(f'"{longest}"')), at_limit)
    assert orders_count(server) == 4


# -- 9. a saturated pool refuses with 503 rather than serving uncounted ----------------------


def test_saturation_answers_503_and_runs_nothing_uncounted(demo: DemoLauncher) -> None:
    # Catches: a full mailbox that blocks or queues without bound (no 503 ever), a 503
    # whose handler still ran (more rows than 201s, or a stored response for a refused
    # key), an execution whose 201 was lost, and a 503 without a retry hint or cause.
    # The demo's limiter shares the 1-slot pool and runs first, so most refusals are
    # its own; the volley repeats (bounded) until the idempotency layer itself has
    # refused at least once, so its saturation path is proven too. Each keyed request
    # reserves --max-stored bytes of its client's quota (4 MiB) while it runs: 1 MiB by
    # default, so on a busy machine a fifth POST in flight got 429 (quota) instead of a
    # run or a 503; 4 KiB (an order's response is ~100 bytes) keeps the quota out of it.
    server = demo.start(
        limit=BIG_LIMIT,
        window=60,
        pool_size=1,
        mailbox=1,
        checkout_latency=0.2,
        max_stored=4096,
    )
    n, attempts = 60, 8
    created: dict[str, httpx.Response] = {}
    refused: set[str] = set()
    refused_by_idempotency: set[str] = set()
    for attempt in range(attempts):
        keys = [f"sat-{attempt}-{i}" for i in range(n)]
        result = volley(
            server.base_url,
            [("/orders", order("tea", i + 1), keyed(k)) for i, k in enumerate(keys)],
        )
        for key, response in zip(keys, result.responses, strict=True):
            if response.status_code == 201:
                assert not is_replay(response)
                created[key] = response
                continue
            body = check_problem(response, 503)
            assert body["cause"] == "saturated", body
            retry = response.headers["Retry-After"]
            assert retry.isdigit(), retry
            assert int(retry) >= 1, retry
            refused.add(key)
            if "idempotency" in body["detail"].lower():
                refused_by_idempotency.add(key)
        if refused_by_idempotency:
            break
    assert refused, f"{attempts * n} concurrent keyed POSTs never saturated a 1-slot mailbox"
    assert refused_by_idempotency, (
        f"{attempts} volleys of {n}: the idempotency layer never answered a saturated 503"
    )

    # Every 201 is exactly one row; no 503 ran the handler.
    rows = order_rows(server)
    assert len(rows) == len(created), (len(rows), len(created), len(refused))
    assert sorted(r.json()["id"] for r in created.values()) == sorted(i for i, _, _ in rows)
    # The requests that got past the limiter: every 201, plus the idempotency refusals.
    assert server.count_for("127.0.0.1") == len(created) + len(refused_by_idempotency)
    # Every executed key has its response stored; no refused key has one.
    wait_until(
        lambda: set(created) <= {k.split(SEP, 1)[1] for k in stored(server.db_path)},
        "every 201 to be stored",
    )
    stored_keys = {k.split(SEP, 1)[1] for k in stored(server.db_path)}
    assert stored_keys == set(created)
    assert not refused & stored_keys
