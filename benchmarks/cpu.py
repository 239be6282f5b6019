"""Where a request's time goes: per-thread CPU and store round trips per request, under load.

    python benchmarks/cpu.py [--duration 3] [--cases limiter,idem-first] [--out benchmarks/cpu.json]

For each case (bench.py's rows, benchmarks/cases.py: the limiter's on every store,
the policies', the first executions' and replays') a real uvicorn server (pinned to
CPU 0) is loaded by wrk (CPU 1) at 64 connections; the kernel's per-thread CPU
counters (/proc/<pid>/task) are read before and after, so the event loop's thread
and the SQLite writer thread are reported apart, in microseconds of CPU per request
(PostgreSQL's and Redis's drivers run on the event loop: their work is in its column),
and the pool's statistics give the store round trips per request (SQLite
transactions, PostgreSQL function calls, Redis pipelines). With the server on one
core, the threads' sum is what sets the throughput. The store server's CPU per
request (PostgreSQL's processes, every backend and background one; redis-server) is
read the same way: it runs on the load's core, and bounds a row whose app core is not
busy. It also counts the collections
of CPython's cyclic garbage collector per 1000 requests (per generation), which a
request that waits across loop iterations brings on. Writes benchmarks/cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, TICK, Server, cpu_seconds, load, machine, used, versions
from _stores import store_servers
from cases import CASES, Case

STORES = ("", "-postgres", "-redis")
# The rows of the per-request table: the references, then porch's rows of bench.py.
ROWS = (
    "bare",
    "bare-headers",
    "bare-ietf-headers",
    "limiter-nostore",
    *(
        f"limiter{kind}{store}"
        for store in STORES
        for kind in ("", "-ietf", "-sliding", "-gcra", "-levels", "-settle", "-concurrency")
    ),
    "bare-post",
    *(f"idem-{kind}{store}" for store in STORES for kind in ("first", "replay")),
)


def thread_cpu(pid: int) -> dict[int, tuple[float, float, int]]:
    """user s, system s and context switches of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        switches = sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK, switches)
    return out


def label(rank: int, is_loop: bool) -> str:
    """A thread's role, from its rank by CPU (see measure)."""
    if is_loop:
        return "event loop"
    return "store writer" if rank == 1 else "store helpers"


def measure(case: Case, duration: int, tmp: Path, servers: dict[str, Any]) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(dir=tmp))
    env = dict(case.env)
    if case.redis:
        env["BENCH_REDIS"] = servers[case.redis].url
    if case.postgres:
        env["BENCH_POSTGRES"] = servers["postgres"].url
        env["BENCH_SCHEMA"] = data.name.replace("-", "_").lower()  # fresh tables per run
    # The store server's processes (PostgreSQL: the postmaster and its children, every
    # backend and background worker; Redis: redis-server), on the load's CPU.
    store_pids: list[int] = []
    if case.postgres:
        store_pids = [servers["postgres"].pid()]
    elif case.redis:
        store_pids = [servers[case.redis].proc.pid]
    server = Server(case.variant, data, env=env)
    path, lua = case.path, case.lua
    try:
        load(server.url, path, lua, connections=64, duration=1, tmp=tmp)
        pid = server.pids()[0]
        stats_before = server.stats()
        before, store_before = thread_cpu(pid), cpu_seconds(store_pids)
        result = load(server.url, path, lua, connections=64, duration=duration, tmp=tmp)
        after, store_after = thread_cpu(pid), cpu_seconds(store_pids)
        stats_after = server.stats()
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    n = result["requests"]
    busy = []
    for tid, (user, system, switches) in after.items():
        u0, s0, c0 = before.get(tid, (0.0, 0.0, 0))
        if (user - u0) + (system - s0) < 0.01:
            continue  # idle helper threads
        busy.append((tid != pid, -((user - u0) + (system - s0)), tid, user, system, switches))
    # CPython 3.11 does not name OS threads: the loop is the main thread, the busiest
    # other one is the store's writer, the rest its helpers (the SQLite checkpointer).
    busy.sort()
    threads = []
    for i, (_, _, tid, user, system, switches) in enumerate(busy):
        u0, s0, c0 = before.get(tid, (0.0, 0.0, 0))
        threads.append(
            {
                "thread": label(i, tid == pid),
                "user_us": round((user - u0) * 1e6 / n, 1),
                "system_us": round((system - s0) * 1e6 / n, 1),
                "switches": round((switches - c0) / n, 3),
            }
        )
    total = sum(t["user_us"] + t["system_us"] for t in threads)
    gc_before, gc_after = stats_before["gc_collections"], stats_after["gc_collections"]
    gc_per_1000 = [round((b - a) * 1000 / n, 2) for a, b in zip(gc_before, gc_after, strict=True)]
    trips = stats_after["transactions"] - stats_before["transactions"]
    return {
        "rps": round(result["rps"], 1),
        "cpu_us": round(total, 1),
        "round_trips": round(trips / n, 4),
        "store_server_us": round(used(store_before, store_after) * 1e6 / n, 1)
        if store_pids
        else None,
        "threads": threads,
        "gc_per_1000_requests": gc_per_1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=int, default=3)
    parser.add_argument("--cases", default=",".join(ROWS), help="bench.py cases")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu.json"))
    args = parser.parse_args()
    if not Path("/proc/self/task").exists():
        print("cpu.py reads /proc: Linux only", file=sys.stderr)
        return 1
    started = time.monotonic()
    by_name = {case.name: case for case in CASES}
    cases = [by_name[name] for name in args.cases.split(",")]
    with (
        tempfile.TemporaryDirectory(prefix="porch-cpu-") as tmp,
        store_servers(cases) as servers,
    ):
        rows = []
        for case in cases:
            row = {"case": case.name, **measure(case, args.duration, Path(tmp), servers)}
            print(case.name, json.dumps(row), flush=True)
            rows.append(row)
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "duration_s": args.duration,
        "cases": rows,
        "elapsed_s": round(time.monotonic() - started),
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
