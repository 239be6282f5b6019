"""Chaos: many ``kill -9`` at random moments under keyed and limited concurrent load.

Threads keep sending rate-limited GETs (four clients, a limit they exceed) and
keyed POSTs (each key sent once, its item naming the key; answered keys are
re-sent to be replayed) at a real ``porch demo`` while the main thread kills the
whole process group with SIGKILL at random moments and restarts it on the same
port and data directory. Afterwards, from the rows:

- no served request is missing from the count (each client's row ≥ the 200s it saw)
  and the limit held (200s seen ≤ the limit);
- every stored response a client received replays byte-identically, and replays seen
  during the chaos were identical too;
- no answered key ran twice, and no key ran more than once at all (none was retried
  after a lost answer).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, launch_demos, order_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KILLS = 12
LIMIT = 200
GET_CLIENTS = ("10.7.0.1", "10.7.0.2", "10.7.0.3", "10.7.0.4")


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


@dataclass
class Seen:
    lock: threading.Lock = field(default_factory=threading.Lock)
    served: Counter[str] = field(default_factory=Counter)  # 200s per GET client
    answered: dict[str, bytes] = field(default_factory=dict)  # key -> the 201 body received
    unanswered: set[str] = field(default_factory=set)
    replays: int = 0
    mismatched_replays: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)


def order(key: str) -> bytes:
    return b'{"item": "%s", "qty": 1}' % key.encode()


def client_of(key: str) -> str:
    """The client a key is sent from: keys are scoped to their caller, so a replay
    must come from the same one. One client per key: never rate-limited."""
    worker, n = (int(part) for part in key[1:].split("-"))
    return f"10.{20 + worker}.{n // 250}.{n % 250}"


def load(base_url: str, seen: Seen, stop: threading.Event, worker: int) -> None:
    rng = random.Random(worker)
    n = 0
    with httpx.Client(base_url=base_url, timeout=10.0, trust_env=False) as http:
        while not stop.is_set() and n < 5000:  # bounded
            n += 1
            roll = rng.random()
            try:
                if roll < 0.4:
                    client = rng.choice(GET_CLIENTS)
                    response = http.get("/products", headers={"X-Forwarded-For": client})
                    if response.status_code == 200:
                        with seen.lock:
                            seen.served[client] += 1
                    elif response.status_code not in (429, 503):
                        seen.bad.append(f"GET {response.status_code} {response.text}")
                elif roll < 0.8 or not seen.answered:
                    key = f"w{worker}-{n}"
                    response = http.post(
                        "/orders",
                        content=order(key),
                        headers={
                            "Content-Type": "application/json",
                            "Idempotency-Key": key,
                            "X-Forwarded-For": client_of(key),
                        },
                    )
                    with seen.lock:
                        if response.status_code == 201:
                            seen.answered[key] = response.content
                        else:
                            seen.unanswered.add(key)
                            if response.status_code != 503:
                                seen.bad.append(f"POST {response.status_code} {response.text}")
                else:
                    with seen.lock:
                        key, body = rng.choice(list(seen.answered.items()))
                    response = http.post(
                        "/orders",
                        content=order(key),
                        headers={
                            "Content-Type": "application/json",
                            "Idempotency-Key": key,
                            "X-Forwarded-For": client_of(key),
                        },
                    )
                    if response.status_code == 201:
                        with seen.lock:
                            seen.replays += 1
                            if (
                                response.content != body
                                or response.headers.get("idempotent-replayed") != "true"
                            ):
                                seen.mismatched_replays.append(key)
                    elif response.status_code != 503:
                        seen.bad.append(f"replay {response.status_code} {response.text}")
            except httpx.HTTPError:
                # Killed mid-request: no answer. A keyed POST is then never retried, so
                # it may have run at most once.
                if 0.4 <= roll < 0.8 or (roll >= 0.8 and not seen.answered):
                    with seen.lock:
                        seen.unanswered.add(f"w{worker}-{n}")
                time.sleep(0.05)


def test_kill_9_at_random_moments_loses_and_repeats_nothing(demo: DemoLauncher) -> None:
    server = demo.start(limit=LIMIT, window=3600, trust_proxy_hops=1, pool_size=2)
    seen = Seen()
    stop = threading.Event()
    threads = [
        threading.Thread(target=load, args=(server.base_url, seen, stop, w), daemon=True)
        for w in range(6)
    ]
    for t in threads:
        t.start()
    rng = random.Random(13)
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.05, 0.8))
            server.kill()
            server.restart(same_port=True)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not seen.bad, seen.bad[:5]
    assert len(seen.answered) > 20, "the load hardly ran"
    assert seen.unanswered, "no kill landed mid-request"
    print(
        f"chaos: {KILLS} kills; {len(seen.answered)} keys answered, {len(seen.unanswered)}"
        f" unanswered, {seen.replays} replays; 200s per client {dict(seen.served)}"
    )

    # No served request missing from the count, and the limit held.
    counters = server.counters()
    for client in GET_CLIENTS:
        row = counters.get(client)
        assert seen.served[client] <= LIMIT, (client, seen.served[client])
        assert (row.count if row else 0) >= seen.served[client], (client, row, seen.served)
        assert (row.count if row else 0) <= LIMIT

    # Every answered key ran exactly once; no key ran twice.
    runs = Counter(item for _, item, _ in order_rows(server))
    assert all(n == 1 for n in runs.values()), [k for k, n in runs.items() if n > 1]
    for key in seen.answered:
        assert runs[key] == 1, key
    assert set(runs) <= set(seen.answered) | seen.unanswered

    # Every response a client received replays byte-identically, now and during the chaos.
    assert not seen.mismatched_replays, seen.mismatched_replays[:5]
    with httpx.Client(base_url=server.base_url, timeout=30.0, trust_env=False) as http:
        for key, body in seen.answered.items():
            replay = http.post(
                "/orders",
                content=order(key),
                headers={
                    "Content-Type": "application/json",
                    "Idempotency-Key": key,
                    "X-Forwarded-For": client_of(key),
                },
            )
            assert replay.status_code == 201, (key, replay.text)
            assert replay.content == body, key
            assert replay.headers["idempotent-replayed"] == "true"
    assert Counter(item for _, item, _ in order_rows(server)) == runs  # replays ran nothing
