"""Where a request's CPU goes: per-thread CPU time per request, under load.

    python benchmarks/cpu.py [--duration 5] [--out benchmarks/cpu.json]

For each case a real uvicorn server (pinned to CPU 0) is loaded by wrk (CPU 1)
at 64 connections; the kernel's per-thread CPU counters (/proc/<pid>/task)
are read before and after, so the event loop's thread and the SQLite writer
thread are reported apart, in microseconds of CPU per request. With the server
on one core, their sum is what sets the throughput. It also counts the
collections of CPython's cyclic garbage collector per 1000 requests (per
generation), which a request that waits across loop iterations brings on.
Writes benchmarks/cpu.json.
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

from _harness import ROOT, Server, load, machine, versions
from cases import GET, POST, POST_NEW_KEY, POST_SAME_KEY

CASES = (
    ("bare", "bare", "/", GET),
    ("limiter", "limiter", "/", GET),
    ("bare-post", "bare", "/orders", POST),
    ("idem-first", "idempotency", "/orders", POST_NEW_KEY),
    ("idem-replay", "idempotency", "/orders", POST_SAME_KEY),
)

TICK = os.sysconf("SC_CLK_TCK")


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


def measure(variant: str, path: str, lua: str, duration: int, tmp: Path) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(dir=tmp))
    server = Server(variant, data)
    try:
        load(server.url, path, lua, connections=64, duration=1, tmp=tmp)
        pid = server.pids()[0]
        gc_before = server.stats()["gc_collections"]
        before = thread_cpu(pid)
        result = load(server.url, path, lua, connections=64, duration=duration, tmp=tmp)
        after = thread_cpu(pid)
        gc_after = server.stats()["gc_collections"]
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
    gc_per_1000 = [round((b - a) * 1000 / n, 2) for a, b in zip(gc_before, gc_after, strict=True)]
    return {
        "rps": round(result["rps"], 1),
        "cpu_us": round(total, 1),
        "threads": threads,
        "gc_per_1000_requests": gc_per_1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu.json"))
    args = parser.parse_args()
    if not Path("/proc/self/task").exists():
        print("cpu.py reads /proc: Linux only", file=sys.stderr)
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="porch-cpu-") as tmp:
        rows = []
        for name, variant, path, lua in CASES:
            row = {"case": name, **measure(variant, path, lua, args.duration, Path(tmp))}
            print(name, json.dumps(row), flush=True)
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
