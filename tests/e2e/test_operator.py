"""The operator CLI (``porch inspect|reset|purge|check``, ``--version``) against a real
running ``porch demo`` and its real SQLite file."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos, porch_cli

import porch
from support import wait_until

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def get(server: DemoServer, client: str) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        return http.get("/products", headers={"X-Forwarded-For": client})


def inspect(*argv: str) -> dict[str, Any]:
    done = porch_cli("inspect", "--json", *argv)
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def forget_and_run_again(server: DemoServer, store: list[str], key: str, client: str) -> None:
    """porch forget: the stored response goes, and the same keyed request runs the handler
    again (a new order) instead of being replayed; a key with nothing stored exits 1."""

    def order() -> httpx.Response:
        with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
            return http.post(
                "/orders",
                json={"item": "tea", "qty": 1},
                headers={"Idempotency-Key": key, "X-Forwarded-For": client},
            )

    replayed = order()
    assert replayed.headers["idempotent-replayed"] == "true"
    # The demo's limit counts the orders too: room for the two below, whatever was used.
    porch_cli("reset", *store, "--client", client)
    done = porch_cli("forget", *store, "--scope", f"client:{client}", "--key", key, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"scope": f"client:{client}", "key": key, "forgotten": 1}
    again = order()
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert again.content != replayed.content  # the handler ran: another order
    assert order().headers["idempotent-replayed"] == "true"  # and that one is stored
    missing = porch_cli("forget", *store, "--scope", f"client:{client}", "--key", "no-such")
    assert missing.returncode == 1
    assert "porch forget: no live stored response for key 'no-such'" in missing.stderr


def test_version() -> None:
    done = porch_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"porch {porch.__version__}"


def test_inspect_and_reset_a_running_server(demo: DemoLauncher) -> None:
    server = demo.start(limit=3, window=600, trust_proxy_hops=1)
    for _ in range(4):
        get(server, "10.3.0.1")
    assert get(server, "10.3.0.1").status_code == 429
    assert get(server, "10.3.0.2").status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": "op-1", "X-Forwarded-For": "10.3.0.2"},
        )
    assert created.status_code == 201

    data = ["--data-dir", str(server.data_dir)]
    document = inspect(*data)
    assert document["store"] == str(server.db_path)
    counters = {c["client"]: c for c in document["counters"]}
    assert set(counters) == {"10.3.0.1", "10.3.0.2"}
    assert counters["10.3.0.1"]["count"] == 3  # refusals consume nothing: the row says so
    assert counters["10.3.0.2"]["count"] == 2
    assert counters["10.3.0.1"]["rule"] == "default"
    assert 0 < counters["10.3.0.1"]["reset_in"] <= 600
    [response] = document["responses"]
    assert response["key"] == "op-1"
    assert response["status"] == 201
    assert response["scope"] == "client:10.3.0.2"
    assert 86000 < response["expires_in"] <= 86400
    assert abs(response["expires_at"] - (time.time() + response["expires_in"])) < 5
    # --client narrows; --store names the same file by URL.
    only = inspect("--store", f"sqlite:///{server.db_path}", "--client", "10.3.0.1")
    assert [c["client"] for c in only["counters"]] == ["10.3.0.1"]
    assert only["responses"] == []
    text = porch_cli("inspect", *data)
    assert text.returncode == 0
    assert "10.3.0.1" in text.stdout
    assert "op-1" in text.stdout

    # reset of another rule, or of a client without counters, deletes nothing: exit 1.
    other = porch_cli("reset", *data, "--client", "10.3.0.1", "--rule", "nosuch")
    assert other.returncode == 1
    assert "client '10.3.0.1' has no live counter of rule 'nosuch'" in other.stderr
    nobody = porch_cli("reset", *data, "--client", "nobody", "--json")
    assert nobody.returncode == 1
    assert json.loads(nobody.stdout) == {"client": "nobody", "rule": None, "deleted": 0}
    assert get(server, "10.3.0.1").status_code == 429
    done = porch_cli("reset", *data, "--client", "10.3.0.1", "--rule", "default")
    assert done.returncode == 0, done.stderr
    assert "deleted 1 counter" in done.stdout
    started = time.monotonic()
    while get(server, "10.3.0.1").status_code != 200:
        # Within the limiter's refusal memory (1 s), plus a loaded machine's slack.
        assert time.monotonic() - started < 10, "not served again after porch reset"
        time.sleep(0.1)
    assert server.count_for("10.3.0.1") == 1
    assert server.count_for("10.3.0.2") == 2  # other clients untouched
    forget_and_run_again(server, data, "op-1", "10.3.0.2")


def test_purge_deletes_expired_rows(demo: DemoLauncher) -> None:
    # A window long enough for six requests on a loaded machine: a row whose window
    # ended before the last of them would be pruned by that request's transaction.
    server = demo.start(limit=10, window=3, trust_proxy_hops=1)
    for n in range(6):
        assert get(server, f"10.4.0.{n}").status_code == 200
    rows = server.counters()
    assert len(rows) == 6
    # Until every window has ended (the demo's clock is this host's monotonic clock):
    # the rows stay until touched (or purged).
    last = max(row.expires for row in rows.values())
    wait_until(lambda: time.monotonic() > last, "every window ended", 10.0)
    assert len(server.counters()) == 6
    done = porch_cli("purge", "--data-dir", str(server.data_dir))
    assert done.returncode == 0, done.stderr
    assert "deleted 6 expired counter(s) and 0 expired response(s)" in done.stdout, done.stdout
    assert server.counters() == {}
    again = porch_cli("purge", "--data-dir", str(server.data_dir), "--json")
    assert json.loads(again.stdout) == {"counters": 0, "responses": 0}
    assert get(server, "10.4.0.1").status_code == 200  # the running server carries on
    assert server.count_for("10.4.0.1") == 1


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_check_healthy_corrupt_and_foreign(tmp_path: Path, demo: DemoLauncher) -> None:
    server = demo.start(limit=1_000_000, window=600, trust_proxy_hops=1)
    for n in range(400):  # enough rows for several b-tree pages
        assert get(server, f"10.5.{n // 250}.{n % 250}").status_code == 200
    healthy = porch_cli("check", "--data-dir", str(server.data_dir))
    assert healthy.returncode == 0, healthy.stderr
    assert "ok (schema version" in healthy.stdout
    as_json = json.loads(porch_cli("check", "--data-dir", str(server.data_dir), "--json").stdout)
    assert as_json["healthy"] is True
    assert as_json["problems"] == []
    assert as_json["schema_version"] == as_json["expected_version"]
    server.terminate()

    # A page in the middle of the file overwritten: integrity_check names the damage.
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(server.db_path, broken / "porch.sqlite3")
    page = 4096
    with open(broken / "porch.sqlite3", "r+b") as f:
        f.seek(3 * page)
        f.write(b"\xa5" * page)
    before = _digest(broken / "porch.sqlite3")
    done = porch_cli("check", "--data-dir", str(broken))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "NOT HEALTHY" in done.stderr
    damaged = porch_cli("check", "--data-dir", str(broken), "--json")
    assert damaged.returncode == 1
    assert json.loads(damaged.stdout)["healthy"] is False
    assert str(broken / "porch.sqlite3") in done.stderr
    assert "integrity_check" in done.stderr or "malformed" in done.stderr, done.stderr
    assert _digest(broken / "porch.sqlite3") == before  # check changes nothing

    for kind in ("garbage", "foreign"):
        other = tmp_path / kind
        other.mkdir()
        path = other / "porch.sqlite3"
        if kind == "garbage":
            path.write_bytes(b"not a database\n" * 500)
        else:
            conn = sqlite3.connect(path)
            conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
            conn.commit()
            conn.close()
        before = _digest(path)
        for command in (
            ["check"],
            ["inspect"],
            ["purge"],
            ["reset", "--client", "x"],
            ["forget", "--scope", "client:x", "--key", "k"],
        ):
            done = porch_cli(*command, "--data-dir", str(other))
            assert done.returncode != 0, (command, done.stdout)
            assert str(path) in done.stderr, done.stderr
            expected = "not a database" if kind == "garbage" else "not a porch store"
            assert expected in done.stderr, done.stderr
        assert _digest(path) == before
        assert sorted(p.name for p in other.iterdir()) == ["porch.sqlite3"]

    missing = porch_cli("inspect", "--data-dir", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2
    assert "no porch store at" in missing.stderr
    assert not (tmp_path / "nothing-here").exists()  # never created


# -- the same commands on a PostgreSQL store ---------------------------------------------------


@pytest.fixture
def pg_databases(postgres_url: str) -> Iterator[tuple[str, str]]:
    """Two databases of this test's own on the session's PostgreSQL server (one stays empty)."""
    asyncpg = pytest.importorskip("asyncpg")
    names = [f"op_{uuid.uuid4().hex[:10]}", f"op_{uuid.uuid4().hex[:10]}"]

    async def sql(statement: str) -> None:
        conn = await asyncpg.connect(postgres_url, timeout=10)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    for name in names:
        asyncio.run(sql(f"CREATE DATABASE {name}"))
    base = postgres_url.rsplit("/", 1)[0]
    yield f"{base}/{names[0]}", f"{base}/{names[1]}"
    for name in names:
        asyncio.run(sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def _age_counters(url: str, seconds: float) -> None:
    """Move every counter ``seconds`` into the past: what the server's clock moving ahead
    would do to them (windows are server time), without waiting for it."""
    import asyncpg

    async def age() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await conn.execute(
                "UPDATE porch.counters SET window_start = window_start - $1,"
                " expires = expires - $1",
                seconds,
            )
        finally:
            await conn.close()

    asyncio.run(age())


@pytest.mark.postgres
def test_operator_commands_on_postgres(demo: DemoLauncher, pg_databases: tuple[str, str]) -> None:
    pg_store, pg_empty = pg_databases
    # A window longer than the test: a hit prunes expired counters (of any client), so
    # a window that ended while the CLI ran would take 10.6.0.2's counter away before
    # the purge, and inspect lists live counters only. Time moves by _age_counters.
    server = demo.start(limit=3, window=60, trust_proxy_hops=1, store=pg_store)
    store = ["--store", pg_store]
    for _ in range(4):
        get(server, "10.6.0.1")
    assert get(server, "10.6.0.1").status_code == 429
    assert get(server, "10.6.0.2").status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": "pg-1", "X-Forwarded-For": "10.6.0.2"},
        )
    assert created.status_code == 201

    document = inspect(*store)
    assert "password" not in document["store"]
    counters = {c["client"]: c for c in document["counters"]}
    assert counters["10.6.0.1"]["count"] == 3
    assert counters["10.6.0.2"]["count"] == 2
    assert 0 < counters["10.6.0.1"]["reset_in"] <= 60
    [response] = document["responses"]
    assert (response["key"], response["status"], response["scope"]) == (
        "pg-1",
        201,
        "client:10.6.0.2",
    )
    healthy = porch_cli("check", *store)
    assert healthy.returncode == 0, healthy.stderr

    done = porch_cli("reset", *store, "--client", "10.6.0.1")
    assert done.returncode == 0, done.stderr
    assert "deleted 1 counter" in done.stdout
    wait_until(lambda: get(server, "10.6.0.1").status_code == 200, "served after porch reset")

    _age_counters(pg_store, 61)  # every window has ended
    purged = porch_cli("purge", *store)
    assert purged.returncode == 0, purged.stderr
    assert "deleted 2 expired counter(s) and 0 expired response(s)" in purged.stdout
    assert inspect(*store)["counters"] == []
    assert porch_cli("check", *store).returncode == 0

    empty = porch_cli("check", "--store", pg_empty)
    assert empty.returncode == 1
    assert "no porch schema here" in empty.stderr
    forget_and_run_again(server, store, "pg-1", "10.6.0.2")


# -- the same commands on a store over two PostgreSQL servers -----------------------------------


@pytest.fixture
def two_pg_databases(postgres_url: str, second_postgres_url: str) -> Iterator[list[str]]:
    """A database of this test's own on each of the session's two PostgreSQL servers."""
    asyncpg = pytest.importorskip("asyncpg")
    name = f"op_{uuid.uuid4().hex[:10]}"

    async def sql(url: str, statement: str) -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    servers = [postgres_url, second_postgres_url]
    for url in servers:
        asyncio.run(sql(url, f"CREATE DATABASE {name}"))
    yield [f"{url.rsplit('/', 1)[0]}/{name}" for url in servers]
    for url in servers:
        asyncio.run(sql(url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.mark.postgres
@pytest.mark.sharded
def test_two_demo_hosts_and_the_operator_commands_on_two_servers(
    demo: DemoLauncher, two_pg_databases: list[str]
) -> None:
    """``porch demo --store URL1 --store URL2`` on two hosts: they count one client exactly
    together and replay a keyed order across hosts; ``porch inspect|reset|forget|check``
    given the same --store options see and change both servers."""
    urls = two_pg_databases
    a = demo.start(limit=3, window=60, trust_proxy_hops=1, store=urls)
    b = demo.start(limit=3, window=60, trust_proxy_hops=1, store=urls)
    store = [arg for url in urls for arg in ("--store", url)]
    clients = [f"10.8.0.{i}" for i in range(1, 9)]
    for client in clients:  # three each, alternating hosts: the fourth is refused
        assert [get(server, client).status_code for server in (a, b, a)] == [200] * 3
        assert get(b, client).status_code == 429
    with httpx.Client(base_url=a.base_url, timeout=30.0, trust_env=False) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": "sh-1", "X-Forwarded-For": "10.8.1.1"},
        )
    assert created.status_code == 201
    with httpx.Client(base_url=b.base_url, timeout=30.0, trust_env=False) as http:
        replayed = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": "sh-1", "X-Forwarded-For": "10.8.1.1"},
        )
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == created.content
    document = inspect(*store)
    counted = {c["client"]: c["count"] for c in document["counters"]}
    assert all(counted[client] == 3 for client in clients)
    assert [r["key"] for r in document["responses"]] == ["sh-1"]
    # The clients' counters live on both servers (each on one).
    found = [inspect("--store", url)["counters"] for url in urls]
    assert all(found)
    assert sum(len(f) for f in found) == len(document["counters"])
    done = porch_cli("reset", *store, "--client", clients[0])
    assert done.returncode == 0, done.stderr
    assert get(b, clients[0]).status_code == 200
    checked = porch_cli("check", *store)
    assert checked.returncode == 0, checked.stderr
    forget_and_run_again(a, store, "sh-1", "10.8.1.1")


# -- and on a Redis store -----------------------------------------------------------------------


@pytest.mark.redis
def test_operator_commands_on_redis(demo: DemoLauncher, redis_url: str) -> None:
    pytest.importorskip("redis")
    # A database of its own (the session's tests use 0), and clients and a key of this
    # run's own, so nothing another run left there is counted or deleted.
    url = redis_url.rsplit("/", 1)[0] + "/7"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(250)}"
    one, two, key = f"{net}.1", f"{net}.2", f"rd-{uuid.uuid4().hex[:8]}"
    # A window far longer than the test (it starts at a client's first request), so no
    # window boundary can fall between the requests and the counts checked below.
    server = demo.start(limit=3, window=60, trust_proxy_hops=1, store=url)
    store = ["--store", url]
    for _ in range(4):
        get(server, one)
    assert get(server, one).status_code == 429
    assert get(server, two).status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": key, "X-Forwarded-For": two},
        )
    assert created.status_code == 201

    document = inspect(*store)
    counters = {c["client"]: c for c in document["counters"] if c["client"].startswith(net)}
    assert counters[one]["count"] == 3
    assert counters[two]["count"] == 2
    assert 0 < counters[one]["reset_in"] <= 60
    [response] = [r for r in document["responses"] if r["key"] == key]
    assert (response["key"], response["status"], response["scope"]) == (
        key,
        201,
        f"client:{two}",
    )
    assert inspect(*store, "--client", one)["responses"] == []
    healthy = porch_cli("check", *store)
    assert healthy.returncode == 0, healthy.stderr

    done = porch_cli("reset", *store, "--client", one)
    assert done.returncode == 0, done.stderr
    assert "deleted 1 counter" in done.stdout
    started = time.monotonic()
    while get(server, one).status_code != 200:
        assert time.monotonic() - started < 10, "not served again after porch reset"
        time.sleep(0.1)
    [again] = inspect(*store, "--client", one)["counters"]
    assert again["count"] == 1  # a fresh window, started by the request after the reset
    # Redis expires the counters itself: every counter of this run's clients carries
    # the window as its TTL on the server (nothing is left for purge to delete).
    import redis

    with redis.Redis.from_url(url) as r:
        names = [k for k in r.scan_iter(match="*:k:*", count=1000) if net.encode() in k]
        ttls = [r.pttl(k) for k in names]
    assert len(names) == 2, names
    assert all(0 < ttl <= 60_000 for ttl in ttls), ttls
    purged = porch_cli("purge", *store)
    assert purged.returncode == 0, purged.stderr
    assert "deleted 0 expired counter(s)" in purged.stdout
    assert porch_cli("check", *store).returncode == 0
    forget_and_run_again(server, store, key, two)


@pytest.mark.redis
def test_operator_commands_on_a_redis_cluster(demo: DemoLauncher, redis_cluster_url: str) -> None:
    """The demo on a Redis Cluster (``--store redis+cluster://…``), and inspect, check,
    reset, purge and forget on it: counters and records live on several primaries."""
    pytest.importorskip("redis")
    url = redis_cluster_url
    net = f"10.{random.randrange(100, 250)}.{random.randrange(250)}"
    one, two, key = f"{net}.1", f"{net}.2", f"rc-{uuid.uuid4().hex[:8]}"
    server = demo.start(limit=3, window=60, trust_proxy_hops=1, store=url)
    store = ["--store", url]
    for _ in range(4):
        get(server, one)
    assert get(server, one).status_code == 429
    assert get(server, two).status_code == 200
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": key, "X-Forwarded-For": two},
        )
    assert created.status_code == 201

    document = inspect(*store)
    counters = {c["client"]: c for c in document["counters"] if c["client"].startswith(net)}
    assert counters[one]["count"] == 3
    assert counters[two]["count"] == 2
    [response] = [r for r in document["responses"] if r["key"] == key]
    assert (response["status"], response["scope"]) == (201, f"client:{two}")
    healthy = porch_cli("check", *store)
    assert healthy.returncode == 0, healthy.stderr

    done = porch_cli("reset", *store, "--client", one)
    assert done.returncode == 0, done.stderr
    assert "deleted 1 counter" in done.stdout
    wait_until(lambda: get(server, one).status_code == 200, within=10)
    [again] = inspect(*store, "--client", one)["counters"]
    assert again["count"] == 1
    purged = porch_cli("purge", *store)
    assert purged.returncode == 0, purged.stderr
    assert porch_cli("check", *store).returncode == 0
    forget_and_run_again(server, store, key, two)
