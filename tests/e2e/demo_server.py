"""Real ``porch demo`` processes on real loopback sockets, for the end-to-end gate.

This is a plain module, not a ``conftest.py``: ``tests/conftest.py`` exists and,
with no ``__init__`` files, mypy would see two top-level modules named
``conftest``. A test module imports it and wraps :func:`launch_demos` in a
``demo`` fixture (pytest puts this directory on ``sys.path``).

A :class:`DemoLauncher`'s ``start(limit=..., window=..., **options)`` runs
``python -m porch demo`` in a subprocess on a free port with its own data
directory, waits until ``GET /health`` answers, and hands back a
:class:`DemoServer` that can be stopped (SIGTERM), killed (SIGKILL) and
restarted on the same data directory. Every process still running at the end
of a test is killed. Counts are read from the SQLite file itself (read-only),
never from logs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from servers import free_port

# The demo's counter key for a client C is DEMO_KEY_PREFIX + C (rule "default", limit "demo").
DEMO_KEY_PREFIX = "rl\x1fdefault\x1fdemo\x1f"
STARTUP_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0

_FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def libfaketime() -> str | None:
    """The libfaketime preload library, or None when libfaketime is not installed."""
    for path in _FAKETIME_LIBS:
        if os.path.exists(path):
            return path
    found = sorted(glob.glob("/usr/lib*/**/libfaketime.so.1", recursive=True))
    return found[0] if found else None


def faketime_env(offset: str) -> dict[str, str]:
    """Environment that shifts only the wall clock of a process by ``offset`` (e.g. "+2h").

    The library is preloaded directly (not through the ``faketime`` wrapper, which
    forks and would keep our signals from reaching the server). The monotonic clock
    is left alone: FAKETIME_DONT_FAKE_MONOTONIC=1.

    With that, libfaketime 0.9.10 (Debian's) times out every ``pthread_cond_timedwait``
    on a monotonic condition variable at once (fixed upstream in wolfcw/libfaketime#503),
    and CPython's GIL waits on one: a thread waiting for the GIL spins instead of
    sleeping, and on a machine whose cores are busy it starves the thread that holds
    it. A demo under coverage then took up to 33 s to start and 30 s to stop (0.5 s
    and 0.2 s without the preload). FAKETIME_FORCE_MONOTONIC_FIX=0 keeps libfaketime
    out of those waits' deadlines; the wall clock is moved all the same.
    """
    lib = libfaketime()
    if lib is None:
        pytest.skip("libfaketime is not installed")
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_FORCE_MONOTONIC_FIX": "0",
    }


@dataclass(frozen=True, slots=True)
class CounterRow:
    """One row of the demo's ``counters`` table."""

    key: str
    count: int
    window_start: float
    expires: float
    wall_start: float

    @property
    def client(self) -> str:
        return self.key.removeprefix(DEMO_KEY_PREFIX)


def _read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)


def _group_alive(pgid: int) -> bool:
    """Whether any process (not a zombie) is still in process group ``pgid``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class DemoServer:
    """One ``porch demo`` process (and its restarts on the same data directory)."""

    def __init__(self, data_dir: Path, log_dir: Path, options: Sequence[str]) -> None:
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.options = tuple(options)
        # ``--uds PATH``: the demo listens on that unix socket (its clients have no address).
        self.uds = options[options.index("--uds") + 1] if "--uds" in options else None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.env: dict[str, str] = {}

    # -- lifecycle -----------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return "http://demo" if self.uds else f"http://127.0.0.1:{self.port}"

    def client(self, **options: Any) -> httpx.Client:
        """An HTTP client of this server, over its unix socket when it listens on one."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(base_url=self.base_url, transport=transport, **options)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "porch.sqlite3"

    @property
    def orders_path(self) -> Path:
        return self.data_dir / "orders.sqlite3"

    def _logs(self) -> tuple[Path, Path]:
        return (
            self.log_dir / f"run{self.runs}.stdout",
            self.log_dir / f"run{self.runs}.stderr",
        )

    def output(self) -> str:
        """The current (or last) run's captured stdout and stderr."""
        out, err = self._logs()
        parts = []
        for name, path in (("stdout", out), ("stderr", err)):
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- {name} ---\n{text}")
        return "\n".join(parts)

    def stderr(self) -> str:
        _, err = self._logs()
        return err.read_text(errors="replace") if err.exists() else ""

    def start(self, *, env: Mapping[str, str] | None = None, port: int | None = None) -> None:
        """Start a run; return once ``GET /health`` answers 200."""
        assert self.proc is None or self.proc.poll() is not None, "server is still running"
        self.runs += 1
        self.port = port if port is not None else free_port()
        self.env = dict(env or {})
        child_env = dict(os.environ)
        # The forwarding trust under test is porch's (--trust-proxy-hops), whatever the
        # runner's environment says to uvicorn.
        child_env.pop("FORWARDED_ALLOW_IPS", None)
        child_env["PYTHONUNBUFFERED"] = "1"
        # A server that does not stop is sent SIGABRT (terminate()): every thread's stack
        # goes to its stderr, so the failure shows where it waits.
        child_env["PYTHONFAULTHANDLER"] = "1"
        child_env.update(self.env)
        command = [
            sys.executable,
            "-m",
            "porch",
            "demo",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.options,
        ]
        out, err = self._logs()
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            # A session of its own: kill() reaches uvicorn's workers too, which
            # would otherwise outlive a SIGKILLed supervisor and keep serving.
            self.proc = subprocess.Popen(
                command,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=child_env,
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        last_error = "no attempt"
        with self.client(timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    pytest.fail(
                        f"porch demo exited with {proc.returncode} before serving\n" + self.output()
                    )
                if self.uds is not None and not os.path.exists(self.uds):
                    # Not listening yet: httpx would leak the socket of a failed connect.
                    time.sleep(0.05)
                    continue
                try:
                    response = client.get(f"{self.base_url}/health")
                except httpx.HTTPError as exc:
                    last_error = repr(exc)
                else:
                    if response.status_code == 200:
                        return
                    last_error = f"GET /health -> {response.status_code}"
                time.sleep(0.05)
        self.kill()
        pytest.fail(
            f"porch demo did not answer GET /health within {STARTUP_TIMEOUT} s "
            f"({last_error})\n" + self.output()
        )

    def terminate(self) -> int:
        """SIGTERM, wait, and check the shutdown was clean; return the exit status."""
        proc = self.proc
        assert proc is not None, "server was never started"
        assert proc.poll() is None, "server is not running"
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # its threads' stacks, to its stderr
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(
                f"porch demo did not stop within {STOP_TIMEOUT} s of SIGTERM (its stacks at"
                " SIGABRT are in its stderr)\n" + self.output()
            )
        # uvicorn shuts down gracefully, then re-raises the signal it caught: a clean stop
        # is exit status 0 or "terminated by SIGTERM", never a crash or another signal.
        assert code in (0, -signal.SIGTERM), f"exit status {code}\n" + self.output()
        assert "Traceback" not in self.stderr(), self.output()
        return code

    def kill(self) -> None:
        """SIGKILL the server and every worker process: no shutdown code runs at all."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _group_alive(proc.pid):
            if time.monotonic() > deadline:
                pytest.fail(f"processes of group {proc.pid} survived SIGKILL")
            time.sleep(0.02)

    def restart(self, *, env: Mapping[str, str] | None = None, same_port: bool = False) -> None:
        """Start again on the same data directory (the previous run must have ended)."""
        assert self.proc is not None, "server was never started"
        assert self.proc.poll() is not None, "stop the server first"
        self.start(env=env, port=self.port if same_port else None)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()

    # -- durable state ---------------------------------------------------------------

    def counters(self) -> dict[str, CounterRow]:
        """Every counter row, by client, read from the SQLite file."""
        if not self.db_path.exists():
            return {}
        conn = _read_only(self.db_path)
        try:
            rows = conn.execute(
                "SELECT key, count, window_start, expires, wall_start FROM counters"
            ).fetchall()
        finally:
            conn.close()
        result: dict[str, CounterRow] = {}
        for key, count, start, expires, wall in rows:
            row = CounterRow(str(key), int(count), float(start), float(expires), float(wall))
            assert row.key.startswith(DEMO_KEY_PREFIX), f"unexpected counter key {row.key!r}"
            result[row.client] = row
        return result

    def rows(self) -> dict[str, int]:
        """Every counter row's count, by its whole key (every rule and level), from the file."""
        if not self.db_path.exists():
            return {}
        conn = _read_only(self.db_path)
        try:
            return {str(k): int(n) for k, n in conn.execute("SELECT key, count FROM counters")}
        finally:
            conn.close()

    def count_for(self, client: str = "127.0.0.1") -> int:
        row = self.counters().get(client)
        return 0 if row is None else row.count


class DemoLauncher:
    """Starts demo servers for one test and kills whatever is left at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: list[DemoServer] = []

    def start(
        self,
        *,
        limit: int,
        window: float,
        env: Mapping[str, str] | None = None,
        **options: int | float | str | Sequence[str],
    ) -> DemoServer:
        """``options`` are further CLI flags: ``pool_size=1`` means ``--pool-size 1``,
        ``worker_header=True`` means ``--worker-header``, ``store=[a, b]`` means
        ``--store a --store b``."""
        n = len(self.servers)
        data_dir = self.root / f"server{n}" / "data"
        log_dir = self.root / f"server{n}" / "logs"
        log_dir.mkdir(parents=True)
        argv = ["--limit", str(limit), "--window", f"{window:g}"]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, (list, tuple)):
                for each in value:
                    argv += [flag, str(each)]
            else:
                argv += [flag] if value is True else [flag, str(value)]
        server = DemoServer(data_dir, log_dir, argv)
        self.servers.append(server)
        server.start(env=env)
        return server

    @staticmethod
    def faketime_env(offset: str) -> dict[str, str]:
        """See :func:`faketime_env`; skips the test when libfaketime is not installed."""
        return faketime_env(offset)


@contextlib.contextmanager
def launch_demos(root: Path) -> Iterator[DemoLauncher]:
    """A launcher whose servers are all killed on exit; a test module's fixture wraps it::

    @pytest.fixture
    def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
        with launch_demos(tmp_path) as launcher:
            yield launcher
    """
    launcher = DemoLauncher(root)
    try:
        yield launcher
    finally:
        for server in launcher.servers:
            server.cleanup()


def porch_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m porch ARGV...`` (the operator's commands), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "porch", *argv], capture_output=True, text=True, timeout=60
    )


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One complete response (status, lower-cased headers, body) from a keep-alive socket."""
    data = b""
    for _ in range(1000):  # bounded: responses here are a few hundred bytes
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
        head, sep, content = data.partition(b"\r\n\r\n")
        if not sep:
            continue
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, value in (line.split(":", 1) for line in header_lines)
        }
        length = int(headers["content-length"])
        if len(content) >= length:
            return int(status_line.split()[1]), headers, content[:length]
    pytest.fail(f"no complete response: {data!r}")


def source_port(response: httpx.Response) -> int:
    """The client-side port of the TCP connection a response arrived on."""
    stream: Any = response.extensions["network_stream"]
    addr = stream.get_extra_info("client_addr")
    assert addr is not None, "the connection's local address is unknown"
    port: int = addr[1]
    return port


def order_rows(server: DemoServer) -> list[tuple[int, str, int]]:
    """Every row of the demo's ``orders`` table: the side effects that really happened."""
    if not server.orders_path.exists():
        return []
    conn = sqlite3.connect(f"file:{server.orders_path}?mode=ro", uri=True, timeout=10.0)
    try:
        rows = conn.execute("SELECT id, item, qty FROM orders ORDER BY id").fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        conn.close()
    return [(int(i), str(item), int(qty)) for i, item, qty in rows]


def parked_waiters(server: DemoServer) -> int:
    """Duplicates parked on ``server`` now: its porch_parked_waiters gauges (one process)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30, trust_env=False).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("porch_parked_waiters{")
        )
    )


def orders_count(server: DemoServer) -> int:
    return len(order_rows(server))
