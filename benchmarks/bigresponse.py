"""Memory of a ``porch demo`` process while a large response is stored and replayed.

    python benchmarks/bigresponse.py [--size-mib 50] [--replays 3] [--store URL]

Starts ``porch demo`` on a loopback port with ``--max-stored`` above the size, sends one
keyed ``POST /exports`` of ``--size-mib`` MiB (the owner's run: captured and stored), then
``--replays`` replays of it, and reads the server's resident memory from
``/proc/PID/status`` every 5 ms meanwhile. Prints the idle RSS, then the peak RSS above
it during the first run and during the replays, in MiB. Flat means the peak does not
grow with the size (issue 29 item 3: bodies streamed in chunks to and from the store).
Bounded: one server, 1 + ``--replays`` requests, each with a 300 s timeout.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=50)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--store", default=None, help="a store URL (default: SQLite)")
    args = parser.parse_args()
    size = args.size_mib << 20
    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        argv = [
            sys.executable, "-m", "porch", "demo", "--port", str(port), "--data-dir", data,
            "--limit", "1000", "--max-stored", str(size + (1 << 20)),
        ]  # fmt: skip
        if args.store:
            argv += ["--store", args.store]
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
            key = {"Idempotency-Key": f"bigresponse-{os.getpid()}"}
            with httpx.Client(timeout=300, trust_env=False) as client:
                first = client.post(base + "/exports", json={"size": size}, headers=key)
                stored = peak.take()
                replays = []
                for _ in range(args.replays):
                    replays.append(client.post(base + "/exports", json={"size": size}, headers=key))
                replayed = peak.take()
            peak.stop()
            ok = all(
                r.headers.get("idempotent-replayed") == "true" and r.content == first.content
                for r in replays
            )
            print(f"response: {args.size_mib} MiB, status {first.status_code}, replays exact: {ok}")
            print(f"idle RSS: {idle / 1024:.1f} MiB")
            print(f"peak above idle, first run (stored): {(stored - idle) / 1024:.1f} MiB")
            print(f"peak above idle, {args.replays} replays: {(replayed - idle) / 1024:.1f} MiB")
            return 0 if ok and first.status_code == 201 else 1
        finally:
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
