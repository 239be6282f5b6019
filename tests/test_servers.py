"""The throwaway servers of tests/servers.py do what the failure legs rely on."""

from __future__ import annotations

import asyncio
import socket

import pytest

from servers import running_postgres, running_redis, running_redis_cluster


def redis_call(port: int, *args: str, within: float = 2.0) -> bytes:
    """One RESP command over a raw socket (no driver needed); raises on timeout."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args
    )
    with socket.create_connection(("127.0.0.1", port), within) as s:
        s.settimeout(within)
        s.sendall(payload)
        return s.recv(1024)


@pytest.mark.redis
def test_redis_server_freezes_thaws_and_keeps_its_aof_over_a_restart() -> None:
    with running_redis(appendonly=True, appendfsync="always") as server:
        assert server.pid > 0
        assert redis_call(server.port, "SET", "k", "v") == b"+OK\r\n"
        server.freeze()
        with pytest.raises(TimeoutError):
            redis_call(server.port, "PING", within=0.5)
        server.thaw()
        assert redis_call(server.port, "PING") == b"+PONG\r\n"
        server.stop(kill=True)
        assert server.pid == 0
        with pytest.raises(ConnectionRefusedError):
            redis_call(server.port, "PING")
        server.start()
        assert redis_call(server.port, "GET", "k") == b"$1\r\nv\r\n"


async def postgres_query(url: str, sql: str, within: float = 5.0) -> list[tuple[object, ...]]:
    import asyncpg

    conn = await asyncpg.connect(url, timeout=within)
    try:
        return [tuple(row) for row in await conn.fetch(sql, timeout=within)]
    finally:
        await conn.close()


@pytest.mark.postgres
def test_postgres_server_freezes_thaws_and_keeps_its_data_over_a_restart() -> None:
    pytest.importorskip("asyncpg")
    with running_postgres() as server:
        run = asyncio.run
        run(postgres_query(server.url, "CREATE TABLE t AS SELECT 7 AS v"))
        assert run(postgres_query(server.url, "SHOW synchronous_commit")) == [("on",)]
        server.freeze()
        # Nothing answers: a new connection times out (the port still accepts).
        with pytest.raises(TimeoutError):
            run(postgres_query(server.url, "SELECT 1", within=1.0))
        server.thaw()
        assert run(postgres_query(server.url, "SELECT 1")) == [(1,)]
        server.freeze()
        server.stop()  # even frozen; -m immediate: a crash, recovered from the WAL at start
        assert server.pid == 0
        server.start()
        assert run(postgres_query(server.url, "SELECT v FROM t")) == [(7,)]


@pytest.mark.redis
def test_redis_cluster_moves_a_slot_fails_over_and_takes_a_node_back() -> None:
    with running_redis_cluster() as cluster:
        assert len(cluster.primaries()) == 3
        slot = cluster.slot("k")
        source = cluster.primary_of(slot)
        assert redis_call(source.port, "SET", "k", "v") == b"+OK\r\n"
        target = next(p for p in cluster.primaries() if p is not source)
        assert cluster.move_slot(slot, target) == 1
        assert cluster.primary_of(slot) is target
        assert redis_call(target.port, "GET", "k") == b"$1\r\nv\r\n"
        assert redis_call(source.port, "GET", "k").startswith(b"-MOVED")
        # A primary killed: its replica serves the slot (and has the key). Replication is
        # asynchronous: without WAIT the kill can come before the migrated key reaches the
        # replica (seen in CI: the promoted replica answered GET with nil).
        replica = cluster.replica_of(target)
        assert redis_call(target.port, "WAIT", "1", "5000", within=6.0) == b":1\r\n"
        target.stop(kill=True)
        cluster.wait_healthy()
        assert cluster.primary_of(slot) is replica
        assert redis_call(replica.port, "GET", "k") == b"$1\r\nv\r\n"
        # Started again, the killed node rejoins as the new primary's replica.
        target.start()
        cluster.wait_healthy()
        assert cluster.replica_of(replica) is target
