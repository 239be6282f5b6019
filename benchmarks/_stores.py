"""Throwaway Redis and PostgreSQL servers on loopback, for the rows that use them."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _harness import free_port, pin

if TYPE_CHECKING:
    from cases import Case


class Redis:
    """A throwaway redis-server on loopback.

    ``appendfsync``: None keeps no AOF; ``"everysec"`` appends every write and
    syncs once a second; ``"always"`` syncs every write before replying.
    """

    def __init__(self, *, appendfsync: str | None = None) -> None:
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="porch-bench-redis-")
        self.port = free_port()
        durability = (
            ["--appendonly", "no"]
            if appendfsync is None
            else ["--appendonly", "yes", "--appendfsync", appendfsync]
        )
        self.proc = subprocess.Popen(
            [
                *pin(1),
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self.dir,
                "--save",
                "",
                *durability,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Postgres:
    """A throwaway PostgreSQL cluster on loopback, with production durability.

    ``fsync`` and ``synchronous_commit`` keep their defaults (on): a commit
    waits for its WAL to reach the disk, as in production. initdb refuses to
    run as root, so as root the cluster runs as the ``postgres`` OS user.
    """

    def __init__(self) -> None:
        bindir = _postgres_bin()
        if bindir is None:
            raise RuntimeError("PostgreSQL not found (apt-get install postgresql)")
        self.dir = Path(tempfile.mkdtemp(prefix="porch-bench-pg-"))
        self.port = free_port()
        user: dict[str, Any] = {}
        if os.geteuid() == 0:
            import pwd

            account = pwd.getpwnam("postgres")
            os.chown(self.dir, account.pw_uid, account.pw_gid)
            user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self._pg_ctl = [str(bindir / "pg_ctl"), "-D", str(self.dir / "data")]
        self._user = user
        subprocess.run(
            [str(bindir / "initdb"), "-A", "trust", "-U", "postgres", "-D", str(self.dir / "data")],
            check=True, capture_output=True, **user,
        )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.dir}"
            " -c max_connections=200"
        )
        # Started under taskset so the server shares CPU 1 with the load, like Redis.
        subprocess.run(
            [*pin(1), *self._pg_ctl, "-l", str(self.dir / "log"), "-o", options, "-w", "start"],
            check=True, capture_output=True, **user,
        )  # fmt: skip
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def pid(self) -> int:
        """The postmaster's pid (every backend is its child)."""
        return int((self.dir / "data" / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        subprocess.run(
            [*self._pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True, **self._user
        )
        shutil.rmtree(self.dir, ignore_errors=True)


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@contextlib.contextmanager
def store_servers(cases: list[Case]) -> Iterator[dict[str, Any]]:
    """The throwaway PostgreSQL and Redis servers the cases need (as bench.py), stopped after."""
    servers: dict[str, Any] = {}
    try:
        if any(c.postgres for c in cases):
            servers["postgres"] = Postgres()
        for fsync in sorted({c.redis for c in cases if c.redis}):
            servers[fsync] = Redis(appendfsync=fsync)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@dataclass(frozen=True)
class Running:
    """Store servers started for a row: the URL ``porch.open_store`` takes (several
    separated by spaces), the servers' pids (PostgreSQL's postmaster: its backends are
    its children) and how many servers."""

    url: str
    pids: list[int]
    servers: int


@contextlib.contextmanager
def running(kinds: set[str]) -> Iterator[dict[str, Running]]:
    """Store servers by kind, stopped after: "postgres" and "redis" (one server, Redis
    without an AOF), "postgres-2" (two PostgreSQL servers: a sharded store) and
    "redis-cluster" (the test suite's cluster, tests/servers.py: 3 primaries, 3 replicas,
    no AOF)."""
    found: dict[str, Running] = {}
    with contextlib.ExitStack() as stack:
        for kind in sorted(kinds):
            if kind in ("postgres", "postgres-2"):
                servers = [Postgres() for _ in range(2 if kind == "postgres-2" else 1)]
                for server in servers:
                    stack.callback(server.stop)
                found[kind] = Running(
                    " ".join(server.url for server in servers),
                    [server.pid() for server in servers],
                    len(servers),
                )
            elif kind == "redis":
                redis = Redis()
                stack.callback(redis.stop)
                found[kind] = Running(redis.url, [redis.proc.pid], 1)
            elif kind == "redis-cluster":
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from servers import running_redis_cluster

                cluster = stack.enter_context(running_redis_cluster(primaries=3, replicas=1))
                found[kind] = Running(cluster.url, [s.pid for s in cluster.servers], 3)
            else:
                raise ValueError(f"unknown store servers {kind!r}")
        yield found
