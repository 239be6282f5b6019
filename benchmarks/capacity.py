"""The capacity model: what one app process and one store server decide per second.

    python benchmarks/capacity.py [--duration 5] [--processes 1 2 4] [--stores sqlite redis]

For each store — SQLite (the embedded default, one host), one PostgreSQL server, one
Redis server, a Redis Cluster (3 primaries, 3 replicas) and two PostgreSQL servers (a
sharded store) — and each number of app processes (uvicorn, one worker each: the porch
limiter over that store; every request a new client among a million, so every request
is a decision on a counter of its own), every process is loaded at once with wrk for
``--duration`` seconds, and the run records:

- decisions per second, in total and per app process: what this box does;
- the CPU time each side spends per decision, from /proc: the app processes', and the
  store servers' (every process of them: PostgreSQL's backends, each cluster node).

On this box (2 cores) app processes, store servers and load generators share the cores,
so the totals flatten where the box saturates, not where a store would. CPU per
decision does not depend on the box: one core of app processes decides about
``1 / app CPU per decision`` a second, one store core ``1 / store CPU per decision``,
and their ratio is how many app cores one store core keeps up with. Writes
benchmarks/capacity.json; benchmarks/render.py puts its table in docs/benchmarks.md and
draws docs/img/capacity.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _harness import ROOT, Server, cpu_seconds, machine, used, versions, wrk_failed
from _stores import Running, running

STORES = ("sqlite", "postgres", "redis", "redis-cluster", "postgres-2")  # (_stores.running)
PROCESSES = (1, 2, 4)
CONNECTIONS = 64  # in all, split between the processes
CLIENTS = 1_000_000

# Every request a client of its own, drawn from a million (X-Forwarded-For, trusted).
LUA = f"""
math.randomseed(@SEED@)
request = function()
  local n = math.random(0, {CLIENTS - 1})
  local ip = string.format("10.%d.%d.%d", math.floor(n / 65536) % 256,
                           math.floor(n / 256) % 256, n % 256)
  return wrk.format("GET", "/", {{["X-Forwarded-For"] = ip}})
end
"""


@contextlib.contextmanager
def store(name: str) -> Iterator[Running | None]:
    """The servers of store ``name`` (None: SQLite, embedded in the app processes)."""
    if name not in STORES:
        raise SystemExit(f"unknown store {name!r}; one of {', '.join(STORES)}")
    if name == "sqlite":
        yield None
        return
    with running({name}) as found:
        yield found[name]


def wrk(urls: list[str], duration: int, tmp: Path) -> list[dict[str, float]]:
    """Load every URL at once (a wrk each, CONNECTIONS split between them)."""
    script = tmp / "capacity.lua"
    script.write_text(LUA.replace("@SEED@", str(secrets.randbelow(1 << 30))))
    each = max(1, CONNECTIONS // len(urls))
    runs = [
        subprocess.Popen(
            ["wrk", "-t1", f"-c{each}", f"-d{duration}s", "-s", str(script), url + "/"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url in urls
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=duration + 60)
        wrk_failed(err)
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        done = re.search(r"(\d+) requests in", out)
        if done is None:
            raise RuntimeError(f"wrk output lacks a request count:\n{out}{err}")
        results.append(
            {"requests": int(done.group(1)), "non_2xx": int(non2xx.group(1)) if non2xx else 0}
        )
    return results


def point(name: str, processes: int, duration: int, tmp: Path) -> dict[str, Any]:
    """One store with ``processes`` app processes, loaded at once."""
    with store(name) as servers:
        store_pids = servers.pids if servers is not None else []
        data = tmp / f"{name}-{processes}"
        data.mkdir()
        env = {"BENCH_TRUST_HOPS": "1", "BENCH_WINDOW": "3600"}
        if servers is not None:
            env["BENCH_STORE_URL"] = servers.url
        apps = [Server("limiter", data, env=env, cpu=None) for _ in range(processes)]
        try:
            urls = [app.url for app in apps]
            wrk(urls, 1, tmp)  # warm-up: pools opened, connections made
            app_pids = [pid for app in apps for pid in app.pids()]
            app0, store0, t0 = cpu_seconds(app_pids), cpu_seconds(store_pids), time.monotonic()
            runs = wrk(urls, duration, tmp)
            elapsed = time.monotonic() - t0
            app_cpu = used(app0, cpu_seconds(app_pids))
            store_cpu = used(store0, cpu_seconds(store_pids))
        finally:
            for app in apps:
                app.stop()
    decisions = sum(r["requests"] for r in runs)
    refused = sum(r["non_2xx"] for r in runs)
    if refused:
        raise RuntimeError(f"{name} x{processes}: {refused} answers not 2xx (the store failed?)")
    rps = decisions / elapsed
    row: dict[str, Any] = {
        "store": name,
        "servers": servers.servers if servers is not None else 0,
        "processes": processes,
        "rps": round(rps, 1),
        "rps_per_process": round(rps / processes, 1),
        "app_cpu_us": round(1e6 * app_cpu / decisions, 1),
        "store_cpu_us": round(1e6 * store_cpu / decisions, 1) if servers is not None else None,
    }
    print(
        f"{name:14} x{processes}: {rps:8.0f} decisions/s, app {row['app_cpu_us']} us"
        f" + store {row['store_cpu_us']} us CPU per decision",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds of load per point")
    parser.add_argument("--processes", type=int, nargs="+", default=list(PROCESSES))
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=STORES)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "capacity.json"), help="where to write"
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (apt-get install wrk; scripts/bench.sh installs it)")
    started = time.monotonic()
    points = []
    with tempfile.TemporaryDirectory(prefix="porch-capacity-") as tmp:
        for name in args.stores:
            for processes in args.processes:
                points.append(point(name, processes, args.duration, Path(tmp)))
    report = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/capacity.py " + " ".join(sys.argv[1:]),
        "seconds": round(time.monotonic() - started),
        "duration_s": args.duration,
        "connections": CONNECTIONS,
        "machine": machine(),
        "versions": versions(),
        "points": points,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
