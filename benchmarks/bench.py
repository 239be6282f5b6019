"""Side-by-side throughput of porch against the bare app, in one run.

    python benchmarks/bench.py [--rounds 3] [--duration 5] [--connections 64]

Each case starts a real uvicorn server (uvloop + httptools) pinned to CPU 0
and loads it with wrk pinned to CPU 1 (where there are two), over loopback.
Cases are interleaved round by round (A B C ... A B C ...) so drift on a noisy
machine hits them alike; the report gives medians and ratios to the bare app.
Store transactions per request come from the server's own pool statistics.
Writes benchmarks/results.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = '{"item": "tea", "qty": 1}'


@dataclass(frozen=True)
class Case:
    name: str
    variant: str  # the server app (benchmarks/apps.py)
    request: str  # get | post | post-new-key | post-same-key
    baseline: str  # the case this one is a ratio to
    what: str


CASES = (
    Case("bare", "bare", "get", "bare", "Starlette hello world, GET /"),
    Case("limiter", "limiter", "get", "bare", "porch limiter, default durability (process)"),
    Case("limiter-power", "limiter-power", "get", "bare", "porch limiter, durability=power"),
    Case("bare-post", "bare", "post", "bare-post", "POST /orders, no idempotency"),
    Case("idem-first", "idempotency", "post-new-key", "bare-post",
         "porch idempotency, a new key per request (first executions)"),
    Case("idem-replay", "idempotency", "post-same-key", "bare-post",
         "porch idempotency, one key (replays)"),
)

LUA = {
    "get": "",
    "post": f"""
wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
""",
    "post-new-key": f"""
local n = 0
local id = tostring(math.random(1, 1e9))
request = function()
  n = n + 1
  return wrk.format("POST", "/orders", {{["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "k-" .. id .. "-" .. n}}, '{BODY}')
end
""",
    "post-same-key": f"""
wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = "the-one-key"
""",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin(cpu: int) -> list[str]:
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", str(cpu)]
    return []


class Server:
    def __init__(self, variant: str, data: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "BENCH_VARIANT": variant, "BENCH_DATA": str(data),
               "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [*pin(0), sys.executable, "-m", "uvicorn", "benchmarks.apps:create", "--factory",
             "--host", "127.0.0.1", "--port", str(self.port), "--loop", "uvloop",
             "--http", "httptools", "--log-level", "warning", "--no-access-log"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/__stats", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.proc.stderr.read().decode() if self.proc.stderr else "")
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/__stats", timeout=5) as r:
            return dict(json.loads(r.read()))

    def peak_rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(r"VmHWM:\s+(\d+) kB", status)
        return int(match.group(1)) / 1024 if match else float("nan")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", value).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def run_wrk(url: str, request: str, connections: int, duration: float, tmp: Path) -> dict[str, float]:
    script = tmp / f"{request}.lua"
    script.write_text(LUA[request])
    out = subprocess.run(
        [*pin(1), "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency",
         "-s", str(script), url + ("/orders" if request.startswith("post") else "/")],
        capture_output=True, text=True, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+([\d.]+\w+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+([\d.]+\w+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(non2xx.group(1)) if non2xx else 0
    return {"rps": rps, "requests": total, "p50_ms": p50, "p99_ms": p99, "non_2xx": errors}


async def _py_load(url: str, request: str, connections: int, duration: float) -> dict[str, float]:
    """A plain asyncio HTTP/1.1 keep-alive load generator, used only when wrk is missing."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    counter = 0
    end = time.monotonic() + duration

    def build() -> bytes:
        nonlocal counter
        counter += 1
        if request == "get":
            return f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        key = {"post-new-key": f"Idempotency-Key: py-{counter}\r\n",
               "post-same-key": "Idempotency-Key: the-one-key\r\n"}.get(request, "")
        return (f"POST /orders HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"{key}Content-Length: {len(BODY)}\r\n\r\n{BODY}").encode()

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        while time.monotonic() < end:
            start = time.perf_counter()
            writer.write(build())
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            latencies.append((time.perf_counter() - start) * 1000)
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {"rps": len(latencies) / elapsed, "requests": len(latencies),
            "p50_ms": latencies[len(latencies) // 2],
            "p99_ms": latencies[int(len(latencies) * 0.99)], "non_2xx": 0}


def measure(case: Case, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    data = Path(tempfile.mkdtemp(prefix=f"porch-bench-{case.name}-", dir=tmp))
    server = Server(case.variant, data)
    try:
        load = run_wrk if shutil.which("wrk") else (
            lambda u, r, c, d, t: asyncio.run(_py_load(u, r, c, d)))
        load(server.url, case.request, args.connections, 1.0, tmp)  # warm up
        before = server.stats()
        result = load(server.url, case.request, args.connections, args.duration, tmp)
        after = server.stats()
        result["txn_per_request"] = (
            (after["transactions"] - before["transactions"]) / result["requests"]
            if result["requests"] else 0.0
        )
        result["peak_rss_mb"] = server.peak_rss_mb()
        return result
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("porch", "starlette", "uvicorn", "uvloop", "httptools"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    if shutil.which("wrk"):
        out["wrk"] = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()[1]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"))
    args = parser.parse_args()
    cases = [c for c in CASES if c.name in args.cases.split(",")]
    if not shutil.which("wrk"):
        print("wrk not found: using the Python load generator (slower; numbers not comparable "
              "with wrk runs). apt-get install wrk for the real thing.", file=sys.stderr)
    runs: dict[str, list[dict[str, float]]] = {c.name: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="porch-bench-") as tmpdir:
        for round_ in range(args.rounds):
            for case in cases:
                r = measure(case, args, Path(tmpdir))
                runs[case.name].append(r)
                print(f"round {round_ + 1} {case.name:14} {r['rps']:9.0f} rps  "
                      f"p99 {r['p99_ms']:6.2f} ms  txn/req {r['txn_per_request']:.4f}",
                      file=sys.stderr)
    medians: dict[str, dict[str, Any]] = {}
    for case in cases:
        rs = runs[case.name]
        medians[case.name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    results = []
    for case in cases:
        m = medians[case.name]
        base = medians.get(case.baseline)
        # The ratio of medians of per-round ratios would hide drift less well: use
        # per-round ratios (each from adjacent measurements), then their median.
        ratios = [r["rps"] / b["rps"] for r, b in zip(runs[case.name], runs[case.baseline])] \
            if base else []
        results.append({
            "variant": case.name, "what": case.what, "baseline": case.baseline,
            "rps": round(m["rps"], 1),
            "ratio_to_bare": round(statistics.median(ratios), 3) if ratios else None,
            "p50_ms": round(m["p50_ms"], 3), "p99_ms": round(m["p99_ms"], 3),
            "added_p99_ms": round(m["p99_ms"] - base["p99_ms"], 3) if base else None,
            "txn_per_request": round(m["txn_per_request"], 4),
            "peak_rss_mb": round(m["peak_rss_mb"], 1), "non_2xx": int(m["non_2xx"]),
            "rounds": [round(r["rps"], 1) for r in runs[case.name]],
        })
    report = {
        "command": "python benchmarks/bench.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.machine(), "server_cpu": 0 if pin(0) else None,
                    "load_cpu": 1 if pin(1) else None},
        "load_generator": "wrk -t1" if shutil.which("wrk") else "python asyncio (wrk missing)",
        "connections": args.connections, "duration_s": args.duration, "rounds": args.rounds,
        "versions": versions(), "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("| variant | rps | ratio | p50 ms | p99 ms | txn/req | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['variant']} | {r['rps']:.0f} | {r['ratio_to_bare']:.2f} | {r['p50_ms']:.2f} "
              f"| {r['p99_ms']:.2f} | {r['txn_per_request']:.4f} | {r['peak_rss_mb']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
