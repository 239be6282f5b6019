"""Side-by-side throughput of porch, its peers and the bare app, in one run.

    python benchmarks/bench.py [--rounds 3] [--duration 5] [--connections 64] [--cases a,b]

Each case starts a real uvicorn server (uvloop + httptools) pinned to CPU 0
and loads it with wrk pinned to CPU 1 (where there are two), over loopback.
Cases run interleaved round by round (A B C ... A B C ...) so drift on a noisy
machine hits them alike; each ratio is taken between measurements of the same
round, and the report gives medians. Store transactions per request come from
the server's own pool statistics. The cases are benchmarks/cases.py. Writes
benchmarks/results.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _harness import (
    ROOT,
    Server,
    connection_split,
    load,
    load_generator,
    machine,
    versions,
)
from _stores import Postgres, Redis, Running, running
from cases import CASES, Case


def measure(
    case: Case,
    args: argparse.Namespace,
    tmp: Path,
    redis: dict[str, Redis],
    postgres: Postgres | None = None,
    several: dict[str, Running] | None = None,
) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=tmp))
    env = dict(case.env)
    if case.servers and several is not None:
        env["BENCH_STORE_URL"] = several[case.servers].url
    if case.redis:
        env["BENCH_REDIS"] = redis[case.redis].url
    if case.postgres and postgres is not None:
        env["BENCH_POSTGRES"] = postgres.url
        env["BENCH_SCHEMA"] = data.name.replace("-", "_").lower()  # fresh tables per run
    server = Server(case.variant, data, workers=case.workers, env=env)
    try:
        load(server.url, case.path, case.lua, connections=args.connections, duration=1, tmp=tmp)
        before = server.stats()
        split: list[list[int] | None] = []
        if case.workers > 1:
            # How the kernel spread the connections over the workers, mid-run.
            sampler = threading.Timer(
                args.duration / 2, lambda: split.append(connection_split(server.port))
            )
            sampler.start()
        result: dict[str, Any] = load(
            server.url,
            case.path,
            case.lua,
            connections=args.connections,
            duration=args.duration,
            tmp=tmp,
        )
        if case.workers > 1:
            sampler.join()
            result["split"] = split[0] if split else None
        after = server.stats()
        # With several workers the stats come from whichever worker answered: no ratio.
        result["txn_per_request"] = (
            (after["transactions"] - before["transactions"]) / result["requests"]
            if case.workers == 1 and result["requests"]
            else float("nan")
        )
        result["peak_rss_mb"] = server.peak_rss_mb()
        return result
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def summarize(cases: list[Case], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    med = {
        c.name: {
            k: statistics.median(r[k] for r in runs[c.name])
            for k in runs[c.name][0]
            if k != "split"
        }
        for c in cases
    }
    out = []
    for case in cases:
        m = med[case.name]
        base = runs.get(case.baseline)
        ratios = [r["rps"] / b["rps"] for r, b in zip(runs[case.name], base or [], strict=False)]
        out.append(
            {
                "variant": case.name,
                "what": case.what,
                "baseline": case.baseline,
                "workers": case.workers,
                "handler_io_ms": float(case.env.get("BENCH_IO_MS", 0)),
                "rps": round(m["rps"], 1),
                "ratio_to_bare": round(statistics.median(ratios), 3) if ratios else None,
                "p50_ms": round(m["p50_ms"], 3),
                "p99_ms": round(m["p99_ms"], 3),
                "added_p99_ms": round(m["p99_ms"] - med[case.baseline]["p99_ms"], 3)
                if case.baseline in med
                else None,
                "txn_per_request": None
                if m["txn_per_request"] != m["txn_per_request"]
                else round(m["txn_per_request"], 4),
                "peak_rss_mb": round(m["peak_rss_mb"], 1),
                "non_2xx": int(m["non_2xx"]),
                "rounds_rps": [round(r["rps"], 1) for r in runs[case.name]],
            }
        )
        if case.workers > 1:
            out[-1]["connections_per_worker"] = [r.get("split") for r in runs[case.name]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"))
    args = parser.parse_args()
    wanted = args.cases.split(",")
    cases = [c for c in CASES if c.name in wanted]
    for c in cases:
        if c.baseline not in wanted:
            parser.error(f"case {c.name} needs its baseline {c.baseline} in --cases")
    if not shutil.which("wrk"):
        print(
            "wrk not found: using the Python load generator (it saturates before a fast "
            "server does; numbers are not comparable with wrk runs). apt-get install wrk",
            file=sys.stderr,
        )
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    redis: dict[str, Redis] = {}
    postgres: Postgres | None = None
    try:
        for kind in sorted({c.redis for c in cases if c.redis}):
            redis[kind] = Redis(appendfsync=kind)
        if any(c.postgres for c in cases):
            postgres = Postgres()
        with (
            tempfile.TemporaryDirectory(prefix="porch-bench-") as tmpdir,
            running({c.servers for c in cases if c.servers}) as several,
        ):
            for round_ in range(args.rounds):
                for case in cases:
                    r = measure(case, args, Path(tmpdir), redis, postgres, several)
                    runs[case.name].append(r)
                    print(
                        f"round {round_ + 1} {case.name:20} {r['rps']:9.0f} rps  "
                        f"p99 {r['p99_ms']:7.2f} ms  txn/req {r['txn_per_request']:.4f}  "
                        f"non-2xx {r['non_2xx']}",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for server in redis.values():
            server.stop()
        if postgres is not None:
            postgres.stop()
    report = {
        "command": "python benchmarks/bench.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_generator": load_generator(),
        "connections": args.connections,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "elapsed_s": round(time.monotonic() - started),  # docs/benchmarks.md states it
        "versions": versions(),
        "results": summarize(cases, runs),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in report["results"]:
        print(
            f"{r['variant']:20} {r['rps']:9.0f} rps  ratio {r['ratio_to_bare']}  "
            f"p99 {r['p99_ms']} ms  txn/req {r['txn_per_request']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
