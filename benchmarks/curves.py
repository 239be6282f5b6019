"""Scaling curves: throughput against concurrency and against distinct client keys,
and the store file and process RSS under a churn of clients that never return.

    python benchmarks/curves.py [--duration 3] [--churn-seconds 30] [--only keys]

Writes benchmarks/curves.json (drawn by benchmarks/render.py); with ``--only``, just
that curve (concurrency, keys or churn), printed and not written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _harness import (
    ROOT,
    Server,
    fresh_script,
    load,
    load_generator,
    machine,
    pin,
    versions,
    wrk_failed,
)

CONCURRENCY = (1, 4, 16, 64, 256)
KEYS = (1, 100, 10_000, 1_000_000)


def keys_lua(k: int) -> str:
    # A forwarded client per request, drawn from k distinct addresses (10.x.y.z).
    return f"""
math.randomseed(@SEED@)
local K = {k}
request = function()
  local n = math.random(0, K - 1)
  local ip = string.format("10.%d.%d.%d", math.floor(n / 65536) % 256,
                           math.floor(n / 256) % 256, n % 256)
  return wrk.format("GET", "/", {{["X-Forwarded-For"] = ip}})
end
"""


CHURN_LUA = """
math.randomseed(@SEED@)
local n = math.random(0, 1000000)
request = function()
  n = n + 1
  local ip = string.format("10.%d.%d.%d", math.floor(n / 65536) % 256,
                           math.floor(n / 256) % 256, n % 256)
  return wrk.format("GET", "/", {["X-Forwarded-For"] = ip})
end
"""


def concurrency_curve(duration: int, tmp: Path) -> list[dict[str, Any]]:
    out = []
    for c in CONCURRENCY:
        row: dict[str, Any] = {"connections": c}
        # Interleaved at each point; the limiter's target is against the bare app sending its
        # headers (bare-headers), what porch's own work is measured from.
        for variant in ("bare", "bare-headers", "limiter"):
            data = Path(tempfile.mkdtemp(dir=tmp))
            server = Server(variant, data)
            try:
                load(server.url, "/", "", connections=c, duration=1, tmp=tmp)
                r = load(server.url, "/", "", connections=c, duration=duration, tmp=tmp)
            finally:
                server.stop()
            row[variant] = {k: r[k] for k in ("rps", "p50_ms", "p99_ms")}
        row["ratio"] = round(row["limiter"]["rps"] / row["bare"]["rps"], 3)
        row["ratio_to_headers"] = round(row["limiter"]["rps"] / row["bare-headers"]["rps"], 3)
        print(
            f"c={c:4} bare {row['bare']['rps']:8.0f}  bare-headers "
            f"{row['bare-headers']['rps']:8.0f}  limiter {row['limiter']['rps']:8.0f}"
            f"  ratio {row['ratio']} ({row['ratio_to_headers']} of bare-headers)",
            file=sys.stderr,
            flush=True,
        )
        out.append(row)
    return out


def keys_curve(duration: int, tmp: Path) -> list[dict[str, Any]]:
    out = []
    for k in KEYS:
        data = Path(tempfile.mkdtemp(dir=tmp))
        server = Server("limiter", data, env={"BENCH_TRUST_HOPS": "1"})
        try:
            load(server.url, "/", keys_lua(k), connections=64, duration=1, tmp=tmp)
            before = server.stats()
            r = load(server.url, "/", keys_lua(k), connections=64, duration=duration, tmp=tmp)
            after = server.stats()
        finally:
            server.stop()
        rows = _rows(data)
        out.append(
            {
                "keys": k,
                "rps": r["rps"],
                "p99_ms": r["p99_ms"],
                "rows": rows,
                "txn_per_request": (after["transactions"] - before["transactions"])
                / max(1, r["requests"]),
            }
        )
        print(f"keys={k:8} {r['rps']:8.0f} rps  rows {rows}", file=sys.stderr, flush=True)
    base = out[0]["rps"]
    for row in out:
        row["ratio_to_one_key"] = round(row["rps"] / base, 3)
    return out


def _rows(data: Path) -> int:
    conn = sqlite3.connect(f"file:{data / 'porch.sqlite3'}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM counters").fetchone()[0])
    finally:
        conn.close()


def churn(seconds: int, window: float, tmp: Path) -> dict[str, Any]:
    """New clients only, a short window: the bounded prune must keep file and RSS flat."""
    data = Path(tempfile.mkdtemp(dir=tmp))
    server = Server("limiter", data, env={"BENCH_TRUST_HOPS": "1", "BENCH_WINDOW": str(window)})
    script = tmp / "churn.lua"
    script.write_text(fresh_script(CHURN_LUA, ""))
    samples: list[dict[str, Any]] = []
    try:
        wrk = (
            subprocess.Popen(
                [
                    *pin(1),
                    "wrk",
                    "-t1",
                    "-c64",
                    f"-d{seconds}s",
                    "-s",
                    str(script),
                    server.url + "/",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            if shutil.which("wrk")
            else None
        )
        if wrk is None:
            thread = threading.Thread(
                target=load,
                args=(server.url, "/", CHURN_LUA),
                kwargs={"connections": 64, "duration": seconds, "tmp": tmp},
            )
            thread.start()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            time.sleep(2)
            s = server.stats()
            samples.append(
                {
                    "t": round(time.monotonic() - start, 1),
                    "db_mb": round(s["db_bytes"] / 2**20, 2),
                    "rss_mb": round(s["rss_bytes"] / 2**20, 1),
                    "rows": _rows(data),
                    "requests": s["calls"],
                }
            )
            print(
                f"churn t={samples[-1]['t']:5}  db {samples[-1]['db_mb']} MB  rss "
                f"{samples[-1]['rss_mb']} MB  rows {samples[-1]['rows']}  "
                f"clients so far {samples[-1]['requests']}",
                file=sys.stderr,
                flush=True,
            )
        if wrk is not None:
            _, stderr = wrk.communicate()
            wrk_failed(stderr)
    finally:
        server.stop()
    if max(x["rows"] for x in samples) < 100:
        raise RuntimeError("the churn run did not reach distinct clients: is the script broken?")
    return {"window_s": window, "seconds": seconds, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=int, default=3)
    parser.add_argument("--churn-seconds", type=int, default=30)
    parser.add_argument("--churn-window", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "curves.json"))
    parser.add_argument("--only", choices=("concurrency", "keys", "churn"), default="")
    args = parser.parse_args()
    started = time.monotonic()
    if args.only:
        with tempfile.TemporaryDirectory(prefix="porch-curves-") as tmpdir:
            tmp = Path(tmpdir)
            if args.only == "churn":
                curve: Any = churn(args.churn_seconds, args.churn_window, tmp)
            else:
                run = concurrency_curve if args.only == "concurrency" else keys_curve
                curve = run(args.duration, tmp)
        print(json.dumps(curve, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="porch-curves-") as tmpdir:
        tmp = Path(tmpdir)
        report = {
            "command": "python benchmarks/curves.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "load_generator": load_generator(),
            "versions": versions(),
            "duration_s": args.duration,
            "concurrency": concurrency_curve(args.duration, tmp),
            "keys": keys_curve(args.duration, tmp),
            "churn": churn(args.churn_seconds, args.churn_window, tmp),
        }
    report["elapsed_s"] = round(time.monotonic() - started)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
