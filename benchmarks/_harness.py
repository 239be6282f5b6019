"""What every benchmark here shares: servers, Redis, the load generator, versions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = '{"item": "tea", "qty": 1}'
TWO_CPUS = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin(cpu: int) -> list[str]:
    """Server on CPU 0, load (and Redis) on CPU 1, where there are two."""
    return ["taskset", "-c", str(cpu)] if TWO_CPUS else []


TICK = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant alive now."""
    found = [pid]
    for tid in _listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                found += _tree(int(child))
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process of the trees under ``pids``."""
    spent: dict[int, float] = {}
    for root in pids:
        for pid in _tree(root):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                spent[pid] = (int(fields[11]) + int(fields[12])) / TICK
    return spent


def used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two samples (processes in both, and those born since)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return dict(json.loads(r.read()))


class Server:
    """A real uvicorn server (uvloop + httptools) running benchmarks/apps.py."""

    def __init__(
        self,
        variant: str,
        data: Path,
        *,
        workers: int = 1,
        env: dict[str, str] | None = None,
        cpu: int | None = 0,
    ) -> None:
        self.port = free_port()
        self.data = data
        full_env = {
            **os.environ,
            "BENCH_VARIANT": variant,
            "BENCH_DATA": str(data),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        cmd = [
            *(pin(cpu) if cpu is not None else []),  # None: wherever the kernel puts it
            sys.executable,
            "-m",
            "uvicorn",
            "benchmarks.apps:create",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--log-level",
            "warning",
            "--no-access-log",
            "--no-proxy-headers",
        ]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        self.proc = subprocess.Popen(
            cmd, env=full_env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.stats()
                return
            except OSError:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"{variant} server exited: {err}") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{variant} server did not start")

    def stats(self) -> dict[str, Any]:
        return _get(self.url + "/__stats")

    def pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            kids = [int(p) for p in children.read_text().split()]
        except OSError:
            kids = []
        # With --workers, the workers serve and the parent only supervises.
        return kids or [self.proc.pid]

    def peak_rss_mb(self) -> float:
        peak = 0
        for pid in self.pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            if match:
                peak = max(peak, int(match.group(1)))
        return peak / 1024

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ms(value: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", value)
    if match is None:
        raise ValueError(f"unexpected wrk latency {value!r}")
    number, unit = match.groups()
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def _field(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"wrk output lacks {pattern!r}:\n{text}")
    return match.group(1)


def connection_split(port: int) -> list[int] | None:
    """Established connections to ``port`` per server process, most first (None without ss)."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
    ).stdout
    per_pid: dict[str, int] = {}
    for pid in re.findall(r"pid=(\d+)", out):
        per_pid[pid] = per_pid.get(pid, 0) + 1
    return sorted(per_pid.values(), reverse=True)


def fresh_script(lua: str, nonce: str) -> str:
    """The Lua script with this run's nonce and random seed filled in."""
    return lua.replace("@NONCE@", nonce).replace("@SEED@", str(secrets.randbelow(1 << 31)))


def wrk_failed(stderr: str) -> None:
    """wrk reports a broken Lua script on stderr and then sends plain requests: refuse that."""
    if stderr.strip():
        raise RuntimeError(f"wrk: {stderr.strip()}")


def load(
    url: str, path: str, lua: str, *, connections: int, duration: int, tmp: Path
) -> dict[str, float]:
    """Load ``url + path`` with wrk (or the Python fallback) and return rps and latencies.

    ``@NONCE@`` and ``@SEED@`` in the script are replaced afresh on every call, so
    a measured run never repeats the keys (or clients) of the warm-up before it.
    """
    nonce = secrets.token_hex(8)
    lua = fresh_script(lua, nonce)
    if shutil.which("wrk") is None:
        return asyncio.run(_py_load(url, path, lua, connections, duration, nonce))
    script = tmp / f"load-{abs(hash(lua))}.lua"
    script.write_text(lua)
    run = subprocess.run(
        [
            *pin(1),
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, duration)}s",
            "--latency",
            "-s",
            str(script),
            url + path,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    wrk_failed(run.stderr)
    out = run.stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "rps": float(_field(r"Requests/sec:\s+([\d.]+)", out)),
        "requests": int(_field(r"(\d+) requests in", out)),
        "p50_ms": _ms(_field(r"\s50%\s+([\d.]+\w+)", out)),
        "p99_ms": _ms(_field(r"\s99%\s+([\d.]+\w+)", out)),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": 1 if errors else 0,
    }


async def _py_load(
    url: str, path: str, lua: str, connections: int, duration: int, nonce: str
) -> dict[str, float]:
    """A plain asyncio HTTP/1.1 keep-alive load generator, used only when wrk is missing.

    It understands the request shapes the Lua scripts here describe: the method,
    body and a per-request Idempotency-Key or X-Forwarded-For."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    counter = 0
    base = secrets.randbelow(1 << 24)  # clients of one run are not the warm-up's
    post = 'wrk.method = "POST"' in lua or '"POST"' in lua
    end = time.monotonic() + duration

    def build() -> bytes:
        nonlocal counter
        counter += 1
        extra = ""
        if "Idempotency-Key" in lua:
            key = "the-one-key" if "the-one-key" in lua else f"k-{nonce}-{counter}"
            extra = f"Idempotency-Key: {key}\r\n"
        if "X-Forwarded-For" in lua:
            n = counter + base
            a, b, c = n >> 16 & 255, n >> 8 & 255, n & 255
            extra += f"X-Forwarded-For: 10.{a}.{b}.{c}\r\n"
        if not post:
            return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()
        return (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {len(BODY)}\r\n\r\n{BODY}"
        ).encode()

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        while time.monotonic() < end:
            start = time.perf_counter()
            writer.write(build())
            head = await reader.readuntil(b"\r\n\r\n")
            match = re.search(rb"(?i)content-length: (\d+)", head)
            await reader.readexactly(int(match.group(1)) if match else 0)
            latencies.append((time.perf_counter() - start) * 1000)
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "requests": len(latencies),
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[int(len(latencies) * 0.99)],
        "non_2xx": 0,
        "socket_errors": 0,
    }


def load_generator() -> str:
    return "wrk -t1" if shutil.which("wrk") else "python asyncio (wrk missing)"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "pinned": TWO_CPUS,
        "server_cpu": 0 if TWO_CPUS else None,
        "load_cpu": 1 if TWO_CPUS else None,
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in (
        "porch",
        "starlette",
        "uvicorn",
        "uvloop",
        "httptools",
        "slowapi",
        "limits",
        "redis",
        "asgi-idempotency-header",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    for tool, flag in (("wrk", "-v"), ("redis-server", "--version")):
        if shutil.which(tool):
            text = subprocess.run([tool, flag], capture_output=True, text=True)
            out[tool] = (text.stdout or text.stderr).splitlines()[0].strip()
    return out
