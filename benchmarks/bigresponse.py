"""Memory of a ``porch demo`` process while a large response is stored and replayed.

    python benchmarks/bigresponse.py [--sizes 10,50,100] [--stores sqlite,postgres,redis]
        [--replays 3] [--src PATH] [--label NAME] [--write]

For each store and size: starts ``porch demo`` on a loopback port with ``--max-stored``
above the size (PostgreSQL and Redis: a throwaway server on loopback, as bench.py's),
sends one keyed ``POST /exports`` of that many MiB (the owner's run: captured and
stored), then ``--replays`` replays of it, and reads the server's resident memory from
``/proc/PID/status`` every 5 ms meanwhile. Prints the idle RSS, then the peak RSS above
it during the first run and during the replays, in MiB. Flat means the peak does not
grow with the size (issue 29 item 3: bodies streamed in chunks to and from the store).

Results are kept in benchmarks/bigresponse.json under ``--label`` (default ``streamed``;
``--src`` runs another checkout's ``src``, e.g. ``--src ../main/src --label before``);
``--write`` renders every label kept there into docs/idempotency.md, between its
``bigresponse`` markers. Bounded: one server at a time, 1 + ``--replays`` requests per
size, each with a 300 s timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_name("bigresponse.json")
DOC = ROOT / "docs" / "idempotency.md"
BEGIN, END = "<!-- bigresponse:begin -->", "<!-- bigresponse:end -->"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Peak:
    """The highest RSS of ``pid`` seen since the last reset, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, _rss_kib(self.pid))
            except OSError:
                return

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def store_server(name: str) -> Iterator[str | None]:
    """The ``--store`` URL of a throwaway server for ``name`` (None: SQLite in the data dir)."""
    if name == "sqlite":
        yield None
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _stores import Postgres, Redis

    server = Postgres() if name == "postgres" else Redis()
    try:
        yield server.url
    finally:
        server.stop()


def measure(src: str, store: str | None, size_mib: int, replays: int) -> dict[str, Any]:
    """One demo process: its idle RSS and its peaks above it, storing then replaying."""
    size = size_mib << 20
    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        argv = [
            sys.executable, "-m", "porch", "demo", "--port", str(port), "--data-dir", data,
            "--limit", "1000", "--max-stored", str(size + (1 << 20)),
        ]  # fmt: skip
        if store:
            argv += ["--store", store]
        env = {**os.environ, "PYTHONPATH": src}
        server = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(base + "/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("porch demo did not start")
                time.sleep(0.1)
            idle = _rss_kib(server.pid)
            peak = Peak(server.pid)
            key = {"Idempotency-Key": f"bigresponse-{os.getpid()}-{size_mib}"}
            with httpx.Client(timeout=300, trust_env=False) as client:
                first = client.post(base + "/exports", json={"size": size}, headers=key)
                stored = peak.take()
                exact = first.status_code == 201 and len(first.content) == size
                for _ in range(replays):
                    again = client.post(base + "/exports", json={"size": size}, headers=key)
                    exact = exact and again.headers.get("idempotent-replayed") == "true"
                    exact = exact and again.content == first.content
                replayed = peak.take()
            peak.stop()
            return {
                "idle_mib": round(idle / 1024, 1),
                "stored_mib": round((stored - idle) / 1024, 1),
                "replayed_mib": round((replayed - idle) / 1024, 1),
                "exact": exact,
            }
        finally:
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


def render(results: dict[str, Any]) -> str:
    """The docs block: one row per label, store and size."""
    lines = [
        BEGIN,
        "| code | store | response | idle RSS | peak above idle, stored | peak above idle,"
        " replays | replays exact |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, run in results["runs"].items():
        for store, sizes in run["stores"].items():
            for size, row in sorted(sizes.items(), key=lambda item: int(item[0])):
                lines.append(
                    f"| {label} | {store} | {size} MiB | {row['idle_mib']} MiB"
                    f" | +{row['stored_mib']} MiB | +{row['replayed_mib']} MiB"
                    f" | {'yes' if row['exact'] else 'NO'} |"
                )
    commands = "; ".join(
        f"`{run['command']}` ({run['date'][:10]})" for run in results["runs"].values()
    )
    lines += ["", f"Measured with {commands}, {results['replays']} replays each.", END]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,50,100", help="MiB, comma-separated")
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--src", default=str(ROOT / "src"), help="the porch checkout's src")
    parser.add_argument("--label", default="streamed", help="what the results are kept under")
    parser.add_argument("--write", action="store_true", help="render into docs/idempotency.md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    stores = [s for s in args.stores.split(",") if s]
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    results["replays"] = args.replays
    run: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(["python", "benchmarks/bigresponse.py", *sys.argv[1:]]).replace(
            " --write", ""
        ),
        "stores": {},
    }
    ok = True
    for name in stores:
        with store_server(name) as url:
            for size in sizes:
                row = measure(args.src, url, size, args.replays)
                ok = ok and row["exact"]
                run["stores"].setdefault(name, {})[str(size)] = row
                print(
                    f"{args.label} {name} {size} MiB: idle {row['idle_mib']} MiB,"
                    f" stored +{row['stored_mib']} MiB, {args.replays} replays"
                    f" +{row['replayed_mib']} MiB, exact: {row['exact']}",
                    flush=True,
                )
    results["runs"][args.label] = run
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    if args.write:
        text = DOC.read_text()
        block = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
        if not block.search(text):
            raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block")
        DOC.write_text(block.sub(lambda _: render(results), text))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
