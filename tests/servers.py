"""Throwaway PostgreSQL and Redis servers on loopback, for the tests that need a real one.

A plain module (tests/conftest.py loads it with ``pytest_plugins``), so any test
can ask for the session fixtures ``postgres_url`` / ``redis_url`` or start a
server of its own for a failure leg::

    with running_redis(appendonly=True) as server:   # a RedisServer
        server.freeze(); ...; server.thaw()
        server.stop(); ...; server.start()

    with running_redis_cluster() as cluster:         # 3 primaries + 3 replicas
        cluster.primary_for("some key").stop(kill=True)   # its replica takes over
        cluster.move_slot(slot, to=other_primary)         # MOVED/ASK meanwhile

``second_postgres_url`` / ``second_redis_url`` are a second server of each kind (the
homes of a sharded store).

The session fixture ``redis_cluster_url`` is a ``redis+cluster://`` URL of a
cluster of six redis-servers in cluster mode (``redis-cli --cluster create``).

``PORCH_TEST_POSTGRES_URL`` / ``PORCH_TEST_REDIS_URL`` point the session fixtures
at an existing server instead. Without the server binaries the tests skip, unless
``PORCH_REQUIRE_BACKENDS`` (a comma list, set by .ci/run; all three when ``CI=true``)
names the backend: then they fail, so CI never goes green by skipping.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

__all__ = [
    "PostgresServer",
    "RedisCluster",
    "RedisServer",
    "free_port",
    "missing_backend",
    "postgres_bin",
    "postgres_url",
    "redis_cluster_url",
    "redis_url",
    "required_backends",
    "running_postgres",
    "running_redis",
    "running_redis_cluster",
    "second_postgres_url",
    "second_redis_url",
]

_START_TIMEOUT = 30.0  # a loaded CI machine; initdb + start takes 1-4 s when quiet


_ALL_BACKENDS = "sqlite,postgres,redis"


def required_backends() -> set[str]:
    """The backends that must run (never skip): PORCH_REQUIRE_BACKENDS, or all of them on CI.

    A CI runner sets ``CI=true``; there, unless PORCH_REQUIRE_BACKENDS says otherwise
    (an empty value requires none), a missing server is a failure too.
    """
    default = _ALL_BACKENDS if os.environ.get("CI", "").lower() in ("true", "1") else ""
    raw = os.environ.get("PORCH_REQUIRE_BACKENDS", default)
    return {name.strip().lower() for name in raw.split(",") if name.strip()}


def missing_backend(backend: str, why: str) -> NoReturn:
    """Skip the test for lack of ``backend`` — or fail it, if CI requires that backend."""
    if backend in required_backends():
        pytest.fail(f"{backend} is required (PORCH_REQUIRE_BACKENDS) but {why}", pytrace=False)
    pytest.skip(f"{backend}: {why}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (a PostgreSQL backend per connection)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_port(port: int, timeout: float, alive: Any) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited while starting")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _wait_redis_ready(port: int, timeout: float, alive: Any, password: str | None = None) -> None:
    """Until PING answers +PONG: Redis accepts connections while it still loads its
    AOF/RDB, and answers every command with -LOADING until it is done."""
    auth = b""
    if password is not None:
        secret = password.encode()
        auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret)
    deadline = time.monotonic() + timeout
    last = b""
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited while loading its data")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.settimeout(1.0)
            s.sendall(auth + b"*1\r\n$4\r\nPING\r\n")
            last = b""
            while last.count(b"\r\n") < (2 if auth else 1):
                chunk = s.recv(1024)
                if not chunk:
                    break
                last += chunk
            if last.startswith(b"+OK\r\n+PONG" if auth else b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on 127.0.0.1:{port} not ready after {timeout} s: {last!r}")


# -- PostgreSQL ------------------------------------------------------------------


def local_address() -> str | None:
    """An IPv4 address of this host that is not loopback (the one its default route
    leaves from), or None: a server listening there is reached as another host would be."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: picks a route, sends nothing
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def postgres_bin() -> Path | None:
    """The newest /usr/lib/postgresql/*/bin holding initdb and pg_ctl (or on PATH)."""
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
    )
    for directory in reversed(candidates):
        if (Path(directory) / "initdb").exists() and (Path(directory) / "pg_ctl").exists():
            return Path(directory)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


class PostgresServer:
    """A throwaway cluster in a temp dir: initdb once, then stop/start/freeze/thaw at will.

    initdb and pg_ctl refuse to run as root, so as root they run as the
    ``postgres`` OS user (the apt package creates it), owning the temp dir.
    fsync is off (a test cluster needs no crash safety against power loss) but
    ``synchronous_commit`` keeps its default: a commit still waits for the WAL write.
    """

    def __init__(self, bindir: Path, *, also_on: str | None = None) -> None:
        self.bindir = bindir
        self.also_on = also_on  # another local address to listen on (trusted like loopback)
        self.dir = Path(tempfile.mkdtemp(prefix="porch-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = 0
        self._user: dict[str, Any] = {}
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user") from None
            os.chown(self.dir, account.pw_uid, account.pw_gid)
            self._user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self._run(
            "initdb", "--no-sync", "-A", "trust", "-U", "postgres", "-E", "UTF8", "-D", self.data
        )
        if also_on is not None:
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {also_on}/32 trust\n")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int:
        """The postmaster's pid (0 when stopped)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def _run(self, tool: str, *args: object) -> None:
        command = [str(self.bindir / tool), *map(str, args)]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT,
            check=False,
            **self._user,
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}\n{log}")

    def start(self) -> None:
        """Start the server (a free port the first time, the same port after a stop)."""
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            port = self.port or free_port()
            options = (
                f"-c listen_addresses=127.0.0.1{',' + self.also_on if self.also_on else ''}"
                f" -p {port} -c unix_socket_directories={self.dir}"
                " -c fsync=off -c full_page_writes=off -c max_connections=200"
            )
            try:
                self._run("pg_ctl", "-D", self.data, "-l", self.log, "-o", options, "-w", "start")
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                continue  # the port was taken meanwhile: another one
            self.port = port
            return

    def stop(self) -> None:
        """Stop at once (``-m immediate``: like a crash, recovery replays the WAL at start)."""
        if self.pid:
            self.thaw()  # a frozen postmaster would never act on the stop
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open, nothing answers."""
        pid = self.pid
        _signal([pid], signal.SIGSTOP)  # first, so it forks no new backend meanwhile
        _signal(_children(pid), signal.SIGSTOP)

    def thaw(self) -> None:
        pid = self.pid
        _signal(_children(pid), signal.SIGCONT)
        _signal([pid], signal.SIGCONT)

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_postgres(*, also_on: str | None = None) -> Iterator[PostgresServer]:
    """A PostgreSQL server of the caller's own (skips or fails when it cannot exist)."""
    bindir = postgres_bin()
    if bindir is None:
        missing_backend("postgres", "no PostgreSQL server binaries (initdb, pg_ctl) found")
    server = PostgresServer(bindir, also_on=also_on)
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL for the whole session: PORCH_TEST_POSTGRES_URL, or a throwaway cluster."""
    external = os.environ.get("PORCH_TEST_POSTGRES_URL")
    if external:
        yield external
        return
    with running_postgres() as server:
        yield server.url


@pytest.fixture(scope="session")
def second_postgres_url() -> Iterator[str]:
    """Another PostgreSQL server's URL for the whole session (a sharded store's second home):
    a throwaway cluster always."""
    with running_postgres() as server:
        yield server.url


# -- Redis -------------------------------------------------------------------------


class RedisServer:
    """A redis-server on a free loopback port with its dir in a temp dir.

    Without ``appendonly`` nothing is persisted (``--save ""``): the unit tests'
    default. ``appendonly=True`` keeps an AOF with ``appendfsync`` as given, so a
    stop/start (or kill -9) leg sees what survives.
    """

    def __init__(
        self,
        binary: str,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        password: str | None = None,
        also_on: str | None = None,
        cluster: bool = False,
    ) -> None:
        self.binary = binary
        self.cluster = cluster  # cluster mode: its node id and view in nodes.conf (its dir)
        self.also_on = also_on  # another local address to listen on
        self.password = password  # requirepass: clients must AUTH
        self.dir = Path(tempfile.mkdtemp(prefix="porch-redis-"))
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = 0
        self.bus_port = 0  # cluster mode: the cluster bus's port (chosen with the port)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's pid (0 when stopped)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else 0

    def _command(self, port: int) -> list[str]:
        return [
            self.binary,
            "--port", str(port),
            "--bind", "127.0.0.1", *([self.also_on] if self.also_on else []),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(self.dir / "server.log"),
            *(["--requirepass", self.password] if self.password is not None else []),
            *(
                # A primary that stops answering is failed over after 1 s (the
                # default 15 s would make a failure leg wait that long); slots of
                # the live primaries keep answering meanwhile.
                ["--cluster-enabled", "yes",
                 "--cluster-config-file", str(self.dir / "nodes.conf"),
                 "--cluster-node-timeout", "1000",
                 "--cluster-port", str(self.bus_port),
                 "--cluster-require-full-coverage", "no"]
                if self.cluster else []
            ),
        ]  # fmt: skip

    def start(self) -> None:
        """Start the server (a free port the first time, the same port after a stop)."""
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            port = self.port or free_port()
            if self.cluster and not self.port:
                self.bus_port = free_port()
            process = subprocess.Popen(
                self._command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                _wait_port(port, _START_TIMEOUT, lambda p=process: p.poll() is None)
                # Listening is not ready: after a restart it answers -LOADING until
                # its AOF is replayed, so wait for a real PONG.
                _wait_redis_ready(
                    port, _START_TIMEOUT, lambda p=process: p.poll() is None, self.password
                )
            except RuntimeError:
                process.kill()
                process.wait()
                if attempt == attempts - 1:
                    log = self.dir / "server.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(
                        f"redis-server did not start on port {port}\n{tail}"
                    ) from None
                continue
            self._process = process
            self.port = port
            return

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (Redis flushes its AOF and exits), or SIGKILL with ``kill=True``."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # a frozen server cannot exit
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout=_START_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def freeze(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers."""
        _signal([self.pid], signal.SIGSTOP)

    def thaw(self) -> None:
        _signal([self.pid], signal.SIGCONT)

    def remove(self) -> None:
        self.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis(
    *,
    appendonly: bool = False,
    appendfsync: str = "everysec",
    password: str | None = None,
    also_on: str | None = None,
) -> Iterator[RedisServer]:
    """A redis-server of the caller's own (skips or fails when there is no binary)."""
    binary = shutil.which("redis-server")
    if binary is None:
        missing_backend("redis", "no redis-server binary on PATH")
    server = RedisServer(
        binary, appendonly=appendonly, appendfsync=appendfsync, password=password, also_on=also_on
    )
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis URL for the whole session: PORCH_TEST_REDIS_URL, or a throwaway redis-server."""
    external = os.environ.get("PORCH_TEST_REDIS_URL")
    if external:
        yield external
        return
    with running_redis() as server:
        yield server.url


@pytest.fixture(scope="session")
def second_redis_url() -> Iterator[str]:
    """Another standalone redis-server's URL for the whole session (a sharded store's
    second home): a throwaway server always."""
    with running_redis() as server:
        yield server.url


# -- Redis Cluster -------------------------------------------------------------------


def _redis_cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """One command through redis-cli (raw replies, one per line); raises if it fails."""
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), "--raw", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    errors = ("ERR", "CLUSTERDOWN", "CROSSSLOT", "MOVED", "ASK", "TRYAGAIN", "IOERR", "BUSY")
    if done.returncode != 0 or done.stdout.startswith(errors):
        raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


class ClusterNode:
    """One node as ``CLUSTER NODES`` shows it."""

    def __init__(self, line: str) -> None:
        fields = line.split()
        self.id = fields[0]
        self.port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        self.flags = set(fields[2].split(","))
        self.primary_id = fields[3] if fields[3] != "-" else None
        self.slots: list[tuple[int, int]] = []
        for spec in fields[8:]:
            if spec.startswith("["):
                continue  # a slot being migrated or imported
            low, _, high = spec.partition("-")
            self.slots.append((int(low), int(high or low)))

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags and not self.flags & {"fail", "fail?"}

    def owns(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


class RedisCluster:
    """A Redis Cluster on loopback: ``primaries`` primaries, each with ``replicas`` replicas.

    Six redis-servers in cluster mode by default (``RedisServer(cluster=True)``),
    joined by ``redis-cli --cluster create``. A node is stopped, frozen or started
    again through its :class:`RedisServer` (``servers``); a primary that stops
    answering is failed over to its replica after the nodes' 1 s timeout
    (:meth:`wait_healthy` waits for that), and one started again rejoins as a replica.
    """

    def __init__(self, binary: str, *, primaries: int = 3, replicas: int = 1) -> None:
        self.servers = [
            RedisServer(binary, cluster=True) for _ in range(primaries * (1 + replicas))
        ]
        self.primaries_at_start = primaries
        self.replicas = replicas

    @property
    def url(self) -> str:
        """``redis+cluster://`` with the first primaries' addresses (the client finds the rest)."""
        seeds = ",".join(
            f"127.0.0.1:{server.port}" for server in self.servers[: self.primaries_at_start]
        )
        return f"redis+cluster://{seeds}"

    def start(self) -> None:
        for server in self.servers:
            server.start()
        done = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{server.port}" for server in self.servers),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT * 2,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        self.wait_healthy()

    def _live(self) -> list[RedisServer]:
        return [server for server in self.servers if server.pid]

    def nodes(self) -> list[ClusterNode]:
        """The cluster as the first live node that answers sees it."""
        for server in self._live():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                text = _redis_cli(server.port, "CLUSTER", "NODES", timeout=2.0)
                return [ClusterNode(line) for line in text.splitlines() if line.strip()]
        raise RuntimeError("no cluster node answers")

    def server(self, node: ClusterNode) -> RedisServer:
        return next(server for server in self.servers if server.port == node.port)

    def slot(self, name: bytes | str) -> int:
        """The hash slot of a Redis key name (as the server computes it)."""
        text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
        return int(_redis_cli(self._live()[0].port, "CLUSTER", "KEYSLOT", text).strip())

    def primary_of(self, slot: int) -> RedisServer:
        """The server that serves ``slot`` now."""
        for node in self.nodes():
            if node.is_primary and node.owns(slot):
                return self.server(node)
        raise RuntimeError(f"no primary serves slot {slot}")

    def primaries(self) -> list[RedisServer]:
        return [self.server(node) for node in self.nodes() if node.is_primary and node.slots]

    def replica_of(self, primary: RedisServer) -> RedisServer:
        nodes = self.nodes()
        ids = {node.port: node.id for node in nodes}
        for node in nodes:
            if node.primary_id == ids[primary.port] and "fail" not in node.flags:
                return self.server(node)
        raise RuntimeError(f"the primary on port {primary.port} has no live replica")

    def wait_healthy(self, timeout: float = _START_TIMEOUT * 2) -> None:
        """Until every live node says ``cluster_state:ok`` and every slot has a live primary
        whose replicas (the live ones) are linked to it."""
        deadline = time.monotonic() + timeout
        problem = ""
        while time.monotonic() < deadline:
            try:
                problem = self._unhealthy()
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                problem = str(exc)
            if not problem:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster is not healthy after {timeout} s: {problem}")

    def _unhealthy(self) -> str:
        for server in self._live():
            info = _redis_cli(server.port, "CLUSTER", "INFO", timeout=2.0)
            if "cluster_state:ok" not in info:
                return f"port {server.port}: not cluster_state:ok"
            if "master_link_status:down" in _redis_cli(
                server.port, "INFO", "replication", timeout=2.0
            ):
                return f"port {server.port}: its link to its primary is down"
        covered = sum(
            high - low + 1 for node in self.nodes() if node.is_primary for low, high in node.slots
        )
        if covered != 16384:
            return f"{covered} of 16384 slots served"
        return ""

    def move_slot(self, slot: int, to: RedisServer, *, each_key: Any = None) -> int:
        """Move ``slot`` to the primary ``to`` the way ``redis-cli --cluster reshard`` does:
        IMPORTING/MIGRATING, MIGRATE 100 keys at a time, then the slot's new owner told to
        every primary. ``each_key()`` runs after each MIGRATE (clients meet ASK meanwhile).
        Returns how many keys moved."""
        source = self.primary_of(slot)
        ids = {node.port: node.id for node in self.nodes()}
        _redis_cli(to.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source.port])
        _redis_cli(source.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[to.port])
        moved = 0
        while True:
            # One key a line (porch's keys hold \x1f, which str.split() takes for a space).
            listed = _redis_cli(source.port, "CLUSTER", "GETKEYSINSLOT", str(slot), "100")
            keys = [key for key in listed.splitlines() if key]
            if not keys:
                break
            _redis_cli(
                source.port, "MIGRATE", "127.0.0.1", str(to.port), "", "0", "5000", "KEYS", *keys
            )
            moved += len(keys)
            if each_key is not None:
                each_key()
        for server in (to, source, *self.primaries()):
            _redis_cli(server.port, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[to.port])
        return moved

    def remove(self) -> None:
        for server in self.servers:
            server.remove()


@contextlib.contextmanager
def running_redis_cluster(*, primaries: int = 3, replicas: int = 1) -> Iterator[RedisCluster]:
    """A Redis Cluster of the caller's own (skips or fails when there are no binaries)."""
    binary = shutil.which("redis-server")
    if binary is None or shutil.which("redis-cli") is None:
        missing_backend("redis", "no redis-server and redis-cli binaries on PATH")
    cluster = RedisCluster(binary, primaries=primaries, replicas=replicas)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A ``redis+cluster://`` URL for the whole session: PORCH_TEST_REDIS_CLUSTER_URL, or a
    throwaway cluster of 3 primaries and 3 replicas."""
    external = os.environ.get("PORCH_TEST_REDIS_CLUSTER_URL")
    if external:
        yield external
        return
    with running_redis_cluster() as cluster:
        yield cluster.url
