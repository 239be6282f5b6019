"""Two hosts on one store URL: two ``porch demo`` processes with the same ``--store``.

On SQLite both hosts are processes of this machine sharing one file (the
network stores run the same legs in their own gate). Each host keeps its own
orders in its ``--data-dir``; counts come from those rows and from the shared
store's tables, never from logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, DemoServer, launch_demos, orders_count, parked_waiters

from support import sqlite_claims, wait_until

pytestmark = [pytest.mark.e2e]

ORDER = {"item": "tea", "qty": 1}
CLIENT_TIMEOUT = 20.0


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def two_hosts(demo: DemoLauncher, store: Path, **options: int | float | str) -> list[DemoServer]:
    url = f"sqlite:///{store}"
    return [demo.start(store=url, **options) for _ in range(2)]  # type: ignore[arg-type]


def test_the_store_url_holds_the_shared_state_and_data_dir_each_hosts_orders(
    demo: DemoLauncher, tmp_path: Path
) -> None:
    # Catches: --store ignored (each host would keep its own counters: 100 served),
    # or the orders moved into the store (GET /orders would count both hosts').
    store = tmp_path / "shared" / "porch.sqlite3"
    hosts = two_hosts(demo, store, limit=50, window=600)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
            responses = await asyncio.gather(
                *(client.get(f"{hosts[i % 2].base_url}/products") for i in range(100))
            )
        return [r.status_code for r in responses]

    codes = asyncio.run(burst())
    assert (codes.count(200), codes.count(429)) == (50, 50)
    assert not hosts[0].db_path.exists()
    assert not hosts[1].db_path.exists()
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count FROM counters").fetchall() == [(50,)]


def test_duplicates_spread_over_two_hosts_run_once_in_about_one_checkout(
    demo: DemoLauncher, tmp_path: Path
) -> None:
    # Catches: ownership per process (two orders), waiters polling or stranded on the
    # other host (far more than one checkout), a waiter refused instead of answered.
    hosts = two_hosts(
        demo, tmp_path / "shared.sqlite3", limit=10_000, window=60, checkout_latency=1
    )

    async def duplicates() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{hosts[i % 2].base_url}/orders",
                        json=ORDER,
                        headers={"Idempotency-Key": "spread-1"},
                    )
                    for i in range(10)
                )
            )

    started = time.monotonic()
    responses = asyncio.run(duplicates())
    elapsed = time.monotonic() - started
    assert [r.status_code for r in responses] == [201] * 10
    assert len({r.content for r in responses}) == 1
    assert orders_count(hosts[0]) + orders_count(hosts[1]) == 1
    assert elapsed < 6.0  # one 1 s checkout, with room for a loaded machine; not ten


def test_a_killed_owner_host_frees_the_key_for_the_other_host(
    demo: DemoLauncher, tmp_path: Path
) -> None:
    # Catches: a claim that outlives its process (a durable marker, a lease): the
    # other host would wait it out or answer 409 instead of serving the key.
    store = tmp_path / "shared.sqlite3"
    hosts = two_hosts(demo, store, limit=10_000, window=60, checkout_latency=3)
    key = {"Idempotency-Key": "crash-1"}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False) as client:
            owner = asyncio.create_task(
                client.post(f"{hosts[0].base_url}/orders", json=ORDER, headers=key)
            )
            await asyncio.to_thread(
                wait_until, lambda: sqlite_claims(store) == 1, "host 0 owns the key", 20.0
            )
            waiter = asyncio.create_task(
                client.post(f"{hosts[1].base_url}/orders", json=ORDER, headers=key)
            )
            await asyncio.to_thread(
                wait_until, lambda: parked_waiters(hosts[1]) == 1, "host 1 parks it", 20.0
            )
            assert not waiter.done()
            hosts[0].kill()
            killed = time.monotonic()
            response = await waiter
            # Host 1 claimed it at once and ran its own 3 s checkout.
            assert time.monotonic() - killed < 3 + 5
            with contextlib.suppress(httpx.HTTPError):  # its server is gone
                await owner
            return response

    served = asyncio.run(scenario())
    assert served.status_code == 201
    assert "idempotent-replayed" not in {k.lower() for k in served.headers}
    assert orders_count(hosts[0]) == 0  # killed before it inserted its order
    assert orders_count(hosts[1]) == 1
