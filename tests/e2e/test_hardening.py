"""Hardening against the machine: a full disk, a locked store, a corrupt or foreign file,
and hostile requests — against real ``porch demo`` processes.

Each leg's promise: a precise 4xx or a 503 naming its cause, never a 500; the
server recovers by itself (no restart); counts come from the SQLite rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def forwarded(client: str) -> dict[str, str]:
    return {"X-Forwarded-For": client}


def check_answer(response: httpx.Response) -> None:
    """A refusal or success — or a 503 naming its cause — never any other 5xx."""
    if response.status_code >= 500:
        assert response.status_code == 503, response.text
        assert response.json()["cause"] in ("store", "saturated"), response.text


def total_count(server: DemoServer) -> int:
    return sum(row.count for row in server.counters().values())


# -- full disk ------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a filler file until the file system is full; return it."""
    filler = directory / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        for _ in range(1 << 20):  # bounded: 4 GiB, far above the tmpfs size
            try:
                f.write(chunk)
            except OSError:
                break
    return filler


def test_full_disk_is_503_store_then_served_again(tmp_path: Path, demo: DemoLauncher) -> None:
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        data = disk / "data"
        logs = tmp_path / "logs"
        logs.mkdir()
        server = DemoServer(
            data, logs, ["--limit", "1000000", "--window", "3600", "--trust-proxy-hops", "1"]
        )
        demo.servers.append(server)
        server.start()
        with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
            for _ in range(20):
                response = http.get("/products", headers=forwarded("10.0.0.1"))
                assert response.status_code == 200
            before = server.count_for("10.0.0.1")
            assert before == 20

            filler = fill(disk)
            full_since = time.monotonic()
            full: Counter[int] = Counter()
            products_served = 0
            products_refused = 0
            for i in range(300):  # new clients: new rows, new pages, more WAL
                response = http.get("/products", headers=forwarded(f"10.1.{i // 250}.{i % 250}"))
                check_answer(response)
                full[response.status_code] += 1
                products_served += response.status_code == 200
                products_refused += response.status_code == 503
                if i % 10 == 0:
                    keyed = http.post(
                        "/orders",
                        json={"item": "tea", "qty": 1},
                        headers={**forwarded("10.0.0.2"), "Idempotency-Key": f"full-{i}"},
                    )
                    check_answer(keyed)
                    full[keyed.status_code] += 1
            assert full[503] > 0, f"the disk never filled up: {full}"
            assert set(full) <= {200, 201, 503}, full

            filler.unlink()
            deadline = time.monotonic() + 30
            while True:  # served again, without a restart
                response = http.get("/products", headers=forwarded("10.0.0.1"))
                check_answer(response)
                if response.status_code == 200:
                    break
                assert time.monotonic() < deadline, "not served again after space came back"
                time.sleep(0.2)
            # The metrics saw every 503 the limiter answered (the orders' own are the demo's).
            scraped = http.get("/metrics").text
        assert server.proc is not None
        assert server.proc.poll() is None, "the server died"
        [unavailable] = [
            float(line.rsplit(" ", 1)[1])
            for line in scraped.splitlines()
            if line.startswith('porch_unavailable_total{cause="store"}')
        ]
        assert unavailable >= products_refused > 0
        # Hundreds of failed transactions, but the store's log line is throttled to one a
        # second, and so are the middlewares' 503 lines.
        seconds = time.monotonic() - full_since
        for needle in ("SQLite transaction failed", "rate limit store failed"):
            lines = server.stderr().count(needle)
            assert 1 <= lines <= seconds + 2, (needle, lines, seconds)
        # Counts intact and exact: the earlier client kept every request it was served, and
        # while the disk was full every 200 was counted and no 503 was (it rolled back).
        assert server.count_for("10.0.0.1") == before + 1
        while_full = sum(
            row.count for client, row in server.counters().items() if client.startswith("10.1.")
        )
        assert while_full == products_served, (while_full, products_served, full)
        assert "Traceback" not in server.stderr(), server.output()
        assert "porch.sqlite3" in server.stderr(), server.output()  # the log names the file
        server.kill()


# -- a store locked beyond busy_timeout ---------------------------------------------------


def test_locked_store_is_503_or_a_short_wait(demo: DemoLauncher) -> None:
    server = demo.start(limit=1_000_000, window=3600)
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        assert http.get("/products").status_code == 200
        # Another process's writer holds the write lock for longer than the demo's
        # busy_timeout (5 s): porch's transactions wait, then fail — closed.
        locker = sqlite3.connect(server.db_path, timeout=1.0, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")
        results: list[tuple[httpx.Response, float]] = []

        def one() -> None:
            with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as c:
                started = time.monotonic()
                response = c.get("/products")
                results.append((response, time.monotonic() - started))

        try:
            threads = [threading.Thread(target=one) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert len(results) == 4
        for response, elapsed in results:
            check_answer(response)
            assert response.status_code == 503, response.text  # the lock outlived busy_timeout
            assert response.json()["cause"] == "store"
            assert elapsed < 20, elapsed  # a bounded wait, not a hang
        after = http.get("/products")
        assert after.status_code == 200, after.text  # the lock is gone: served again
    assert server.count_for() == 2  # the refused requests counted nothing
    assert "Traceback" not in server.stderr(), server.output()


# -- a corrupt or foreign store file ---------------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["garbage", "foreign"])
def test_a_corrupt_or_foreign_file_is_named_and_left_untouched(
    tmp_path: Path, demo: DemoLauncher, kind: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = data / "porch.sqlite3"
    if kind == "garbage":
        path.write_bytes(b"this is not a database, it is someone's notes\n" * 200)
    else:
        other = sqlite3.connect(path)
        other.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        other.execute("INSERT INTO users (name) VALUES ('ada')")
        other.commit()
        other.close()
    before = _digest(path)
    logs = tmp_path / "logs"
    logs.mkdir()
    server = DemoServer(data, logs, ["--limit", "10", "--window", "60"])
    demo.servers.append(server)
    server.start()  # it serves (health is exempt) and answers 503 where it needs the store
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        for _ in range(3):
            response = http.get("/products")
            assert response.status_code == 503, response.text
            assert response.json()["cause"] == "store"
            keyed = http.post(
                "/orders", json={"item": "tea", "qty": 1}, headers={"Idempotency-Key": "k"}
            )
            check_answer(keyed)
    server.terminate()
    err = server.stderr()
    assert str(path) in err, err  # the message names the file
    expected = "file is not a database" if kind == "garbage" else "not a porch store"
    assert expected in err, err
    assert _digest(path) == before, "porch changed a file that is not its own"
    assert not Path(str(path) + "-wal").exists() or kind == "garbage"
    assert [p.name for p in data.iterdir() if p.name.startswith("porch.sqlite3")] == [
        "porch.sqlite3"
    ], list(data.iterdir())


# -- a short bounded fuzz against the real process -------------------------------------------

_TOKEN = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_PRINTABLE = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
).map(str.strip)  # h11 (the client) refuses surrounding whitespace


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=st.one_of(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        st.text(alphabet=_TOKEN, min_size=1, max_size=8),
    ),
    path=st.one_of(st.sampled_from(["/orders", "/products", "/metrics"]), st.text(max_size=30)),
    headers=st.dictionaries(
        st.sampled_from(
            ["Idempotency-Key", "X-Forwarded-For", "Forwarded", "Authorization", "Content-Type"]
        ),
        _PRINTABLE,
        max_size=4,
    ),
    body=st.one_of(st.binary(max_size=200), st.just(b'{"item": "tea", "qty": 1}')),
)
def test_fuzzing_the_demo_never_answers_5xx(
    fuzz_server: DemoServer, method: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30.0, trust_env=False) as http:
        target = "/" + quote(path.lstrip("/"), safe="/?=&")
        response = http.request(method, target, headers=headers, content=body)
    check_answer(response)


@pytest.fixture
def fuzz_server(demo: DemoLauncher) -> Iterator[DemoServer]:
    server = demo.start(limit=1_000_000, window=3600, trust_proxy_hops=1)
    yield server
    assert "Traceback" not in server.stderr(), server.output()
