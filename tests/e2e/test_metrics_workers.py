"""``GET /metrics`` of ``porch demo --workers 2`` reports the sum over both workers.

Requests go on fresh connections from several threads until both workers have
served some (read from the ``X-Demo-Worker`` header); then every scrape, from
whichever worker answers it, must count exactly the 200s and 429s the clients
saw — a per-process registry would report only the scraping worker's share.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from demo_server import DemoLauncher, launch_demos
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def fresh_get(base_url: str, path: str) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=15.0, trust_env=False) as http:
        return http.get(path)


def counted(text: str) -> dict[tuple[str, str], float]:
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "porch_ratelimit_requests_total":
                values[(s.labels["rule"], s.labels["outcome"])] = s.value
            elif s.name == "porch_store_commit_seconds_count":
                values[("commits", "")] = s.value
    return values


def test_metrics_sum_every_worker(demo: DemoLauncher) -> None:
    # A killed demo's metrics directory (its pid no longer runs) is removed at the next start.
    stale = Path(tempfile.gettempdir()) / "porch-metrics-999999999-test"
    stale.mkdir(exist_ok=True)
    server = demo.start(limit=40, window=300, workers=2, worker_header=True)
    assert not stale.exists()
    statuses: Counter[int] = Counter()
    workers: Counter[str] = Counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        for batch in range(10):  # bounded: 72+ requests, until both workers served some
            for response in pool.map(lambda _: fresh_get(server.base_url, "/products"), range(24)):
                statuses[response.status_code] += 1
                workers[response.headers["x-demo-worker"]] += 1
            if len(workers) == 2 and batch >= 2:
                break
    assert len(workers) == 2, f"one worker served everything: {workers}"
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] == 40  # one client, limit 40
    scraped_by: set[str] = set()
    for _ in range(40):
        response = fresh_get(server.base_url, "/metrics")
        assert response.status_code == 200, response.text
        assert "ratelimit" not in response.headers.get("ratelimit-policy", "x")  # exempt
        values = counted(response.text)
        assert values[("default", "allowed")] == statuses[200], (response.text, workers)
        assert values[("default", "refused")] == statuses[429]
        assert values[("commits", "")] >= 1
        scraped_by.add(response.headers["x-demo-worker"])
        if len(scraped_by) == 2:
            break
    assert len(scraped_by) == 2, "every scrape landed on one worker"
    server.terminate()
