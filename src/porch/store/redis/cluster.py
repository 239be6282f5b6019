"""The Redis Cluster store: the Redis store's scripts, each call in one hash slot.

``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` for TLS), with
redis-py's cluster client. Every script call's keys share a hash tag
(:mod:`.keys`), so each runs atomically on the primary of its slot. What one
call does on a standalone server but spans slots here is split per slot, and
the split never admits more than the standalone store would; it may refuse
more for one round trip (docs/stores/redis-cluster.md states each bound):

- **a hit on several levels** (a rule counting the caller, an organisation and
  everyone: one tag per level) is decided in two steps, each on every level's
  slot at once: how many of the hits each level lets through, writing nothing
  (a refused hit changes nothing, as on one server), then each counts that many.
  Hits of other hosts in between may leave a level room for fewer: the least
  stands, and what the others counted beyond it is given back (a settle of the
  difference, slots taken beyond it vacated); until then another request can
  be refused by that count: over-refusal, transient, never over-admission;
- **byte quotas**: a record and its scope's book share a slot, its client's book
  and the store's are in others. A claim takes the record first, then its
  reservation in the other two books, and releases the claim if they refuse it;
  a save counts its size in those two books first and stores after, undoing the
  counting if it is fenced or refused. Their entries are named by record *and*
  token, so an undo never touches another claim's; a claim still held keeps its
  entries alive with its heartbeat (they cannot read its record in another slot);
- **wake-ups**: the Save and Release scripts ``SPUBLISH`` on a shard channel of
  their record's slot; each process subscribes to every such channel (one per
  record tag, ``WAKE_TAGS``) on the primaries, one connection per primary.

A connection that fails marks the slot map stale; the next batch asks the
cluster again, so after a failover the store follows the new primary by itself
(the batches meanwhile fail: StoreError, 503). Nothing is resent after a reply
was lost (a script may have run); MOVED/ASK/TRYAGAIN are followed, since the
command did not run. ``?wait_replicas=N`` sends ``WAIT N timeout`` after each
primary's commands of a pipeline, on the same connection, and fails the batch
(StoreError) if fewer replicas acknowledged within ``wait_timeout`` seconds:
what asynchronous replication would lose at a failover is then only what was
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from importlib import metadata
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from ..._tasks import stop_if_cancelled
from ...errors import ConfigurationError, StoreError
from .._leases import CLAIM, Lease, Renewer, confirm_late, let_lapse
from ..alike import collapse_hits
from ..base import Claim, Hit, Lookup, Quota, Release, Save, Settle, StoreOp, Vacate
from ..transport import check_transport
from ..urls import redact
from .claims import Renewals, Subscription
from .commands import Command, command, fill_from_reply, release
from .keys import KeyNames
from .store import RedisStore, _close_client

__all__ = ["ClusterUrl", "RedisClusterStore", "cluster_client", "parse_cluster_url"]

SCHEMES = ("redis+cluster", "rediss+cluster")
_DEFAULT_QUOTA = Quota()
# The byte books a Cluster keeps in slots of their own: a client's, and the store's.
_CLOSE_TIMEOUT = 1.0


class ClusterUrl:
    """A ``redis+cluster://`` URL taken apart: the seed nodes, the client's options, and
    porch's own (``wait_replicas``, ``wait_timeout``)."""

    __slots__ = ("options", "seeds", "tls", "wait_replicas", "wait_timeout")

    def __init__(
        self,
        seeds: list[tuple[str, int]],
        options: dict[str, Any],
        *,
        tls: bool,
        wait_replicas: int,
        wait_timeout: float,
    ) -> None:
        self.seeds = seeds
        self.options = options
        self.tls = tls
        self.wait_replicas = wait_replicas
        self.wait_timeout = wait_timeout


def parse_cluster_url(url: str) -> ClusterUrl:
    """``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]``.

    Options are redis-py's (as in a ``redis://`` URL: ``ssl_ca_certs=``...) and porch's:
    ``wait_replicas`` (replicas that must acknowledge each batch's writes, default 0)
    and ``wait_timeout`` (seconds to wait for them, default 0.5). Raises
    ConfigurationError for anything else.
    """
    from redis.asyncio.connection import parse_url

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"a Redis Cluster store URL starts with redis+cluster:// or rediss+cluster://,"
            f" got {redact(url)!r}"
        )
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, port = _host_port(item.strip(), url)
        seeds.append((host, port))
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError(f"a Redis Cluster has database 0 only: {redact(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {name: value for name, value in query if name in ("wait_replicas", "wait_timeout")}
    theirs = [(name, value) for name, value in query if name not in ours]
    try:
        wait_replicas = int(ours.get("wait_replicas", "0"))
        wait_timeout = float(ours.get("wait_timeout", "0.5"))
    except ValueError:
        raise ConfigurationError(
            f"wait_replicas is a whole number and wait_timeout seconds: {redact(url)!r}"
        ) from None
    if not 0 <= wait_replicas <= 16:
        raise ConfigurationError(f"wait_replicas must be 0-16, got {wait_replicas}")
    if not 0 < wait_timeout <= 60 or not math.isfinite(wait_timeout):
        raise ConfigurationError(f"wait_timeout must be > 0 and <= 60 seconds, got {wait_timeout}")
    base = "rediss" if scheme == "rediss+cluster" else "redis"
    host, port = seeds[0]
    single = f"{base}://{userinfo + '@' if userinfo else ''}{_netloc(host, port)}/0"
    if theirs:
        single += "?" + urlencode(theirs)
    try:
        options = dict(parse_url(single))
    except ValueError as exc:
        raise ConfigurationError(redact(f"bad Redis Cluster URL {url}: {exc}")) from None
    for name in ("host", "port", "db", "path"):
        options.pop(name, None)
    tls = options.pop("connection_class", None) is not None or base == "rediss"
    if tls:
        options["ssl"] = True
    return ClusterUrl(
        seeds, options, tls=tls, wait_replicas=wait_replicas, wait_timeout=wait_timeout
    )


def cluster_client(url: str, *, timeout: float = 5.0) -> Any:
    """A redis-py ``RedisCluster`` client for a ``redis+cluster://`` URL (for tools and
    tests that read or clean a cluster; the store makes its own). Close it with aclose()."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    parsed = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in parsed.seeds],
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        **parsed.options,
    )


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [v6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    try:
        port = int(port_text) if port_text else 6379
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise ConfigurationError(
            f"a Redis Cluster seed is host:port, got {item!r} in {redact(url)!r}"
        )
    return unquote(host), port


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Books:
    """The quota reservations this process's claims hold in other slots' books: renewed
    with their claims by the heartbeat (another thread, hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], tuple[str, str, int]] = {}

    def hold(self, key: str, token: int, scope: str, client: str, size: int) -> None:
        with self._lock:
            self._held[key, token] = (scope, client, size)

    def end(self, key: str, token: int) -> None:
        with self._lock:
            self._held.pop((key, token), None)

    def get(self, key: str, token: int) -> tuple[str, str, int] | None:
        with self._lock:
            return self._held.get((key, token))


class _ClusterRenewals(Renewals):
    """Renewals that also keep a held claim's reservation in its client's and the store's
    books (other slots: the renew script cannot read them)."""

    def __init__(self, books: _Books, *args: Any) -> None:
        super().__init__(*args)
        self._books = books

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        results = await super().renew(leases)
        extra: list[Command] = []
        for lease in leases:
            held = self._books.get(lease.key, lease.token) if lease.kind == CLAIM else None
            if held is not None:
                scope, client, size = held
                member = self._names.book_member(lease.key, lease.token)
                for zset, sizes, _ in _other_books(self._names, lease.key, scope, client):
                    extra.append(("book", [zset, sizes], ["renew", member, self._lease_ms, size]))
        if extra:
            await self._run(extra)
        return results

    async def release(self, leases: Sequence[Lease]) -> None:
        # At close: the claims, and their entries in the other slots' books at once (a
        # waiter elsewhere need not find those bytes counted until the lease's end).
        await super().release(leases)
        drops: list[Command] = []
        for lease in leases:
            held = self._books.get(lease.key, lease.token) if lease.kind == CLAIM else None
            if held is not None:
                scope, client, _ = held
                member = self._names.book_member(lease.key, lease.token)
                for zset, sizes, _ in _other_books(self._names, lease.key, scope, client):
                    drops.append(("book", [zset, sizes], ["drop", member]))
                self._books.end(lease.key, lease.token)
        if drops:
            await self._run(drops)


def _other_books(
    names: KeyNames, key: str, scope: str, client: str
) -> list[tuple[bytes, bytes, int]]:
    """The quota books of ``key`` outside its record's slot, each with which it is (the
    bucket a Claim's ``over`` names: 1 scope, 2 client, 3 total)."""
    books = [(*names.client(client), 2), (names.total_zset, names.total_sizes, 3)]
    if not names.same_slot(key, scope):
        books.insert(0, (*names.scope(scope), 1))
    return books


class ClusterSubscription(Subscription):
    """The Cluster store's :class:`~porch.store._watches.Channel`: every wake channel,
    ``SSUBSCRIBE``\\ d on the primary serving its slot, one connection per primary.

    A connection lost, or a channel the server unsubscribed (its slot moved), ends
    :meth:`listen`; the listener then subscribes again on the cluster as it is then,
    and every watch looks once (``Watches``).
    """

    name = "the Redis Cluster wake-up channels"

    def __init__(
        self, channels: list[bytes], timeout: float, connect: Callable[[str, int], Any]
    ) -> None:
        super().__init__(b"")
        self.channels = channels
        self.timeout = timeout
        self.connect = connect  # a client of one node, by host and port
        # self.client: the store's RedisCluster (for the slot map), set at open

    async def listen(self, deliver: Callable[[str], None], ready: Callable[[], None]) -> None:
        cluster: Any = self.client
        if cluster is None:
            raise StoreError("the Redis Cluster store is not open")
        async with asyncio.timeout(self.timeout):
            # The slot map as it is now (initialize() reads it the first time only, and
            # only an initialized client closes its nodes' connections at aclose()).
            await cluster.initialize()
            await cluster.nodes_manager.initialize()
        by_node: dict[str, tuple[Any, list[bytes]]] = {}
        for channel in self.channels:
            node = cluster.get_node_from_key(channel)
            by_node.setdefault(node.name, (node, []))[1].append(channel)
        clients: list[Any] = []
        pubsubs: list[Any] = []
        try:
            for node, channels in by_node.values():
                client = self.connect(node.host, node.port)
                clients.append(client)
                pubsub = client.pubsub()
                pubsubs.append(pubsub)
                async with asyncio.timeout(self.timeout):
                    for channel in channels:
                        # One command per channel: an SSUBSCRIBE of several must name one slot.
                        await pubsub.ssubscribe(channel)
            confirmed = [0]
            total = len(self.channels)

            async def read(pubsub: Any) -> None:
                async for message in pubsub.listen():
                    stop_if_cancelled()
                    kind = message["type"]
                    if kind == "smessage":
                        deliver(bytes(message["data"]).decode("utf-8", "surrogatepass"))
                    elif kind == "ssubscribe":
                        confirmed[0] += 1
                        if confirmed[0] == total:
                            ready()
                    elif kind == "sunsubscribe":  # the slot left that node: look again
                        return

            readers = [asyncio.ensure_future(read(pubsub)) for pubsub in pubsubs]
            try:
                done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
                for reader in done:
                    reader.result()  # its error, if it failed
            finally:
                for reader in readers:
                    reader.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
        finally:  # cancelled too
            for pubsub in pubsubs:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_CLOSE_TIMEOUT):
                        await pubsub.aclose()
            for client in clients:
                await _close_client(client)


# redis.asyncio's PubSub takes SSUBSCRIBE (sharded pub/sub: the wake-ups) from redis-py 8.0.
_DRIVER_FLOOR = 8


def _check_driver() -> None:
    """A precise ConfigurationError for a redis-py too old for the cluster's wake-ups,
    not a subscription that never confirms at open."""
    try:
        found = metadata.version("redis")
    except metadata.PackageNotFoundError:
        return  # RedisStore.__init__ says which extra to install
    major = found.split(".", 1)[0]
    if major.isdigit() and int(major) < _DRIVER_FLOOR:
        raise ConfigurationError(
            f"the Redis Cluster store needs redis-py {_DRIVER_FLOOR}.0 or newer (sharded"
            f" pub/sub in redis.asyncio), found {found}: pip install 'porch[redis-cluster]'"
        )


class RedisClusterStore(RedisStore):
    """Counters, stored responses and idempotency claims in a Redis Cluster.

    ``url``: ``redis+cluster://[user:password@]host:port[,host:port...]`` (the seed
    nodes; the client finds the rest), ``rediss+cluster://`` for TLS; the query may add
    ``wait_replicas=N`` and ``wait_timeout=seconds`` (see the module). Every other
    option is :class:`~porch.store.redis.RedisStore`'s; ``max_connections`` is per node.
    """

    _CLUSTER = True

    def __init__(self, url: str, **options: Any) -> None:
        self._parsed = parse_cluster_url(url)
        _check_driver()
        self._books = _Books()
        # The clients (by id: the store's, the heartbeat's on its own thread and loop)
        # whose slot map must be read again before their next pipeline.
        self._stale: set[int] = set()
        super().__init__(url, **options)

    def _check_url(self, url: str) -> None:
        parse_cluster_url(url)

    def _new_subscription(self) -> Subscription:
        return ClusterSubscription(
            self.names.wake_channels(), self.connect_timeout + self.timeout, self._connect_node
        )

    def _connect_node(self, host: str, port: int) -> Any:
        """A client of one node (a wake-up subscription's), with the cluster's options."""
        from redis.asyncio import Redis

        return Redis(
            host=host,
            port=port,
            socket_connect_timeout=self.connect_timeout,
            socket_timeout=self.timeout,
            socket_keepalive=True,
            **self._parsed.options,
        )

    def _connect(self, max_connections: int) -> Any:
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        parsed = self._parsed
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.seeds],
            max_connections=max_connections,
            socket_connect_timeout=self.connect_timeout,
            socket_timeout=self.timeout,
            socket_keepalive=True,
            # Never resend: a script whose reply was lost may have run (a hit counted).
            # Redirections (MOVED, ASK, TRYAGAIN: the command did not run) are followed.
            retry=Retry(NoBackoff(), 0),
            **parsed.options,
        )

    def _check_transport(self, client: Any) -> None:
        import ssl

        options = self._parsed.options
        required = options.get("ssl_cert_reqs", "required")
        verified = (
            required == ssl.CERT_REQUIRED or str(required).lower() == "required"
        ) and options.get("ssl_check_hostname", True) not in (False, "false", "0", "no")
        check_transport(
            "Redis Cluster",
            self.url,
            self._parsed.seeds[0][0],
            tls=self._parsed.tls,
            verified=verified,
            setting="rediss+cluster:// with ssl_ca_certs=<the servers' CA> (certificate and"
            " host checked)",
        )

    def _renewals(self) -> Renewer:
        return _ClusterRenewals(
            self._books,
            lambda: self._connect(1),
            self._execute,
            _close_client,
            self.names,
            self._lease_ms,
        )

    def admin(self) -> Any:
        from .admin import RedisAdmin

        location = f"{redact(self.url)} (prefix {self.prefix})"
        return RedisAdmin(self._connect, _close_client, self.names, location, self.clock)

    # -- sending ---------------------------------------------------------------------

    async def _load_scripts(self, client: Any) -> None:
        # SCRIPT LOAD goes to every node (a replica promoted later has them too; one
        # that joins later is loaded on its first NOSCRIPT).
        for script in self._scripts.values():
            sha = await client.script_load(script.source)
            if (sha.decode() if isinstance(sha, bytes) else sha) != script.sha:
                raise StoreError(f"Redis loaded script {script.name} under an unexpected SHA")

    async def _send(self, client: Any, commands: list[Command]) -> list[Any]:
        await self._refresh(client)
        try:
            return await super()._send(client, commands)
        except StoreError as exc:
            # A node unreachable, or a cluster that moved: read the slot map again before
            # the next batch (a failover's new primary, a slot's new home).
            from redis.exceptions import ClusterError, ConnectionError, TimeoutError

            if isinstance(exc.__cause__, (ConnectionError, TimeoutError, ClusterError, OSError)):
                self._stale.add(id(client))
            raise

    async def _refresh(self, client: Any) -> None:
        if id(client) not in self._stale:
            return
        # One refresh at a time per client is redis-py's (its nodes manager's lock).
        self._stale.discard(id(client))
        try:
            async with asyncio.timeout(self.connect_timeout + self.timeout):
                await client.nodes_manager.initialize()
        except Exception as exc:
            self._stale.add(id(client))
            raise StoreError(redact(f"Redis Cluster {self.url}: no slot map: {exc!r}")) from exc

    async def _pipeline(self, client: Any, commands: list[Command]) -> list[Any]:
        scripts = self._scripts
        wait = self._parsed.wait_replicas
        async with client.pipeline(transaction=False) as pipe:
            nodes: dict[str, Any] = {}
            for script, keys, args in commands:
                if script is None:
                    pipe.execute_command("HMGET", keys[0], *args)
                else:
                    pipe.execute_command("EVALSHA", scripts[script].sha, len(keys), *keys, *args)
                if wait:
                    node = client.get_node_from_key(keys[0])
                    nodes.setdefault(node.name, node)
            # WAIT after each primary's commands, on the connection that sent them (a
            # cluster pipeline sends one node's commands on one connection, in order).
            timeout_ms = max(1, math.ceil(self._parsed.wait_timeout * 1000))
            for node in nodes.values():
                pipe.execute_command("WAIT", wait, timeout_ms, target_nodes=node)
            results = list(await pipe.execute(raise_on_error=False))
        acknowledged = results[len(commands) :]
        for count in acknowledged:
            if isinstance(count, Exception) or int(count) < wait:
                raise StoreError(
                    f"Redis Cluster: a primary's writes reached {count!r} replicas within"
                    f" {self._parsed.wait_timeout:g}s, {wait} required (wait_replicas)"
                )
        return results[: len(commands)]

    # -- applying a batch ------------------------------------------------------------

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        group = self._group
        if group is None:
            raise StoreError("the Redis store is not open")
        sent, alike = collapse_hits(ops)
        names, lease_ms, clock = self.names, self._lease_ms, self.clock
        now = None if clock is None else clock.monotonic()
        wall = None if clock is None else clock.wall()
        results: list[Any] = [None] * len(sent)
        started = asyncio.get_running_loop().time()
        try:
            for wave in _waves(
                names, sent, [self._split(op, alike.get(i), now) for i, op in enumerate(sent)]
            ):
                single = [i for i, plan in wave if plan is None]
                jobs = [self._into(results, i, plan()) for i, plan in wave if plan is not None]
                if single:
                    commands = [
                        command(names, lease_ms, sent[i], alike.get(i), now) for i in single
                    ]
                    jobs.append(self._into_all(results, single, group.run(commands)))
                outcomes = await asyncio.gather(*jobs, return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        if isinstance(outcome, StoreError):
                            raise outcome
                        raise StoreError(redact(f"Redis Cluster {self.url}: {outcome!r}"))
        except StoreError:
            self._failures += 1
            let_lapse(self._held, ops)  # nobody will end what it took or was ending
            for op in ops:
                if (type(op) is Save or type(op) is Release) and op.token:
                    self._books.end(op.key, op.token)
            raise
        self._operations += len(ops)
        for i, (op, result) in enumerate(zip(sent, results, strict=True)):
            fill_from_reply(self._held, op, result, alike.get(i), wall)
            self._note_books(op)
        if self._heartbeat is not None:
            await confirm_late(self._heartbeat, sent, started)

    async def _into(self, results: list[Any], i: int, plan: Awaitable[Any]) -> None:
        results[i] = await plan

    async def _into_all(self, results: list[Any], at: list[int], replies: Awaitable[Any]) -> None:
        for i, result in zip(at, _checked(await replies, self.url), strict=True):
            results[i] = result

    def _note_books(self, op: StoreOp) -> None:
        if type(op) is Claim:
            if op.token and op.quota is not None and op.reserve > 0:
                self._books.hold(op.key, op.token, op.scope, op.client, op.reserve)
        elif (type(op) is Save or type(op) is Release) and op.token:
            self._books.end(op.key, op.token)

    async def _run(self, commands: list[Command]) -> list[Any]:
        group = self._group
        if group is None:
            raise StoreError("the Redis store is not open")
        return _checked(await group.run(commands), self.url)

    def _split(
        self, op: StoreOp, alike: list[Hit] | None, now: float | None
    ) -> Callable[[], Awaitable[Any]] | None:
        """What applies ``op`` across slots (called once its turn comes), or None: one
        command does it."""
        names = self.names
        if type(op) is Hit:
            tags = {names.counter_tag(key) for key in (*op.keys, *(op.slots or ()))}
            return None if len(tags) <= 1 else functools.partial(self._hit, op, alike, now)
        if type(op) is Settle:
            tags = {names.counter_tag(key) for key in op.keys}
            return None if len(tags) <= 1 else functools.partial(self._settle, op, now)
        if type(op) is Vacate:
            tags = {names.counter_tag(key) for key in op.slots}
            return None if len(tags) <= 1 else functools.partial(self._vacate, op)
        if type(op) is Claim:
            if op.quota is None or op.reserve <= 0:
                return None
            return functools.partial(self._claim, op)
        if type(op) is Save:
            return functools.partial(self._save, op)
        if type(op) is Release:
            return functools.partial(self._release, op)
        return None

    # A hit on several slots: every slot decides at once; the least allowed stands.

    def _limit_groups(self, keys: Sequence[str]) -> list[list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.names.counter_tag(key), []).append(i)
        return list(groups.values())

    async def _hit(self, op: Hit, alike: list[Hit] | None, now: float | None) -> list[Any]:
        names, lease_ms = self.names, self._lease_ms
        m = 1 if alike is None else len(alike)
        slots = list(op.slots or ())
        # Per slot (hash tag): its limits and its slot keys, by position in the hit.
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for i, key in enumerate(op.keys):
            groups.setdefault(names.counter_tag(key), ([], []))[0].append(i)
        for j, key in enumerate(slots):
            groups.setdefault(names.counter_tag(key), ([], []))[1].append(j)
        plan = list(groups.values())
        parts = [_sub_hit(op, limits, taken) for limits, taken in plan]
        slotted = sum(1 for _, taken in plan if taken)

        def calls(count: int, probe: bool, first: int = 0) -> list[Command]:
            made = []
            for part in parts:
                script, keys, args = command(names, lease_ms, part, [part] * count, now)
                if probe:
                    args[1] = -count  # decide, write nothing (counters.lua)
                if part.slots and first:
                    args[len(args) - len(part.slots) - 3] = first  # _slots.lua's first token
                made.append((script, keys, args))
            return made

        # First every slot says how many of the hits it would let through, writing
        # nothing: a hit refused anywhere changes nothing anywhere, as on one server.
        replies = await self._run(calls(m, probe=True))
        allowed = min(int(reply[0]) for reply in replies)
        first = 0
        if allowed > 0:
            # Slots of several sets take one token: the next that none of them gave yet.
            if slotted > 1:
                first = max(
                    int(r[-1]) for r, (_, taken) in zip(replies, plan, strict=True) if taken
                )
            # Then each counts them. Another host's hits in between may leave one slot
            # room for fewer: the least stands, and what the others counted beyond it is
            # given back (refused meanwhile by that count: over-refusal, transient).
            replies = await self._run(calls(allowed, probe=False, first=first))
            counted = [int(reply[0]) for reply in replies]
            kept = [
                0 if taken and int(reply[-1]) < 0 else n
                for n, reply, (_, taken) in zip(counted, replies, plan, strict=True)
            ]
            allowed = min(kept)
            await self._give_back(op, plan, replies, counted, kept, allowed, now)
            if allowed > 0 and slotted:
                first = next(
                    int(r[-1]) for r, (_, taken) in zip(replies, plan, strict=True) if taken
                )
        # Each slot read its own node's TIME: the latest stands for the decision, so no
        # window reads as longer than it is.
        out: list[Any] = [allowed, max((reply[1] for reply in replies), key=float)]
        per_limit: list[Any] = [None] * len(op.keys)
        in_flight: list[Any] = [None] * len(slots)
        for (limits, taken), reply in zip(plan, replies, strict=True):
            for at, i in enumerate(limits):
                per_limit[i] = reply[2 + 3 * at : 5 + 3 * at]
            base = 2 + 3 * len(limits)
            for at, j in enumerate(taken):
                in_flight[j] = reply[base + at]
        for state in per_limit:
            out.extend(state)
        if slots:
            out.extend(in_flight)
            out.append(first)
        return out

    async def _give_back(
        self,
        op: Hit,
        plan: list[tuple[list[int], list[int]]],
        replies: list[Any],
        counted: list[int],
        kept: list[int],
        allowed: int,
        now: float | None,
    ) -> None:
        names, lease_ms = self.names, self._lease_ms
        undo: list[Command] = []
        for (limits, taken), reply, n, k in zip(plan, replies, counted, kept, strict=True):
            if limits and n > allowed:
                give_back = Settle(
                    [op.keys[i] for i in limits],
                    [op.amounts[i] for i in limits],
                    [op.windows[i] for i in limits],
                    [-(n - allowed) * op.cost] * len(limits),
                    [float(reply[4 + 3 * at]) for at in range(len(limits))],
                    algorithms=_pick(op.algorithms, limits),
                    bursts=_pick(op.bursts, limits),
                )
                undo.append(command(names, lease_ms, give_back, None, now))
            if taken and k > allowed:
                first = int(reply[-1])
                keys = [names.slot((op.slots or ())[j]) for j in taken]
                undo.extend(
                    ("vacate", keys, [str(token)]) for token in range(first + allowed, first + k)
                )
        if undo:
            await self._run(undo)

    async def _settle(self, op: Settle, now: float | None) -> list[Any]:
        calls = [
            command(
                self.names,
                self._lease_ms,
                Settle(
                    [op.keys[i] for i in members],
                    [op.amounts[i] for i in members],
                    [op.windows[i] for i in members],
                    [op.deltas[i] for i in members],
                    [op.stamps[i] for i in members],
                    algorithms=_pick(op.algorithms, members),
                    bursts=_pick(op.bursts, members),
                ),
                None,
                now,
            )
            for members in self._limit_groups(op.keys)
        ]
        replies = await self._run(calls)
        return list(replies[0])

    async def _vacate(self, op: Vacate) -> int:
        groups: dict[str, list[bytes]] = {}
        for key in op.slots:
            groups.setdefault(self.names.counter_tag(key), []).append(self.names.slot(key))
        replies = await self._run([("vacate", keys, [str(op.token)]) for keys in groups.values()])
        return sum(int(reply) for reply in replies)

    # Claims, saves and releases: the record's slot, then its client's and the store's books.

    def _take(
        self, op: Claim | Save, token: int, size: int, until_ms: int, ttl_ms: int
    ) -> tuple[list[Command], list[int]]:
        """Commands counting ``size`` bytes for the claim in its books outside its record's
        slot, and which book each is."""
        quota = op.quota if op.quota is not None else _DEFAULT_QUOTA
        caps = {1: quota.scope_bytes, 2: quota.client_bytes, 3: quota.total_bytes}
        member = self.names.book_member(op.key, token)
        books = _other_books(self.names, op.key, op.scope, op.client)
        commands: list[Command] = [
            ("book", [zset, sizes], ["take", member, size, caps[which], until_ms, ttl_ms])
            for zset, sizes, which in books
        ]
        return commands, [which for _, _, which in books]

    def _drop(self, op: Claim | Save | Release, token: int) -> list[Command]:
        member = self.names.book_member(op.key, token)
        return [
            ("book", [zset, sizes], ["drop", member])
            for zset, sizes, _ in _other_books(self.names, op.key, op.scope, op.client)
        ]

    async def _claim(self, op: Claim) -> list[Any]:
        (reply,) = await self._run([command(self.names, self._lease_ms, op)])
        if int(reply[0]) != 2:
            return list(reply)
        token = int(reply[1])
        lease_ms = self._lease_ms
        takes, which = self._take(op, token, op.reserve, lease_ms, max(2 * lease_ms, 60000))
        taken = await self._run(takes)
        over = [which[i] for i, done in enumerate(taken) if int(done) != 1]
        if not over:
            return list(reply)
        # Refused by a book in another slot: the claim is given back, whole.
        await self._run(
            [release(self.names, op.key, op.scope, op.client, token), *self._drop(op, token)]
        )
        return [3, over[0]]

    async def _save(self, op: Save) -> bytes:
        ttl_ms = max(1, math.ceil(op.ttl * 1000))
        token = op.token or 0
        takes, _ = self._take(op, token, op.size, ttl_ms, ttl_ms)
        taken = await self._run(takes)
        if any(int(done) != 1 for done in taken):
            # Over a quota in another slot: nothing is stored, the claim ends (as the
            # save script does over its scope's), waiters are woken.
            undo = self._drop(op, token)
            if token:
                undo.append(release(self.names, op.key, op.scope, op.client, token))
            await self._run(undo)
            return b"quota"
        (outcome,) = await self._run([command(self.names, self._lease_ms, op)])
        text = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if text != "saved":
            await self._run(self._drop(op, token))
        return text.encode()

    async def _release(self, op: Release) -> Any:
        replies = await self._run(
            [
                release(self.names, op.key, op.scope, op.client, op.token),
                *self._drop(op, op.token),
            ]
        )
        return replies[0]


def _touches(names: KeyNames, op: StoreOp) -> set[tuple[str, str]]:
    """The counters, slot keys and records ``op`` reads or writes (not its quota books:
    their sums commute, so ops counting in them need no order among themselves)."""
    if type(op) is Hit:
        return {("k", key) for key in op.keys} | {("s", key) for key in op.slots or ()}
    if type(op) is Settle:
        return {("k", key) for key in op.keys}
    if type(op) is Vacate:
        return {("s", key) for key in op.slots}
    if isinstance(op, (Claim, Lookup, Save, Release)):
        return {("r", op.key)}
    return set()


def _waves(
    names: KeyNames, ops: list[StoreOp], plans: list[Callable[[], Awaitable[Any]] | None]
) -> list[list[tuple[int, Callable[[], Awaitable[Any]] | None]]]:
    """The batch in waves run one after another, so ops on one key keep their order: one
    pipeline keeps it among single commands, but an op split over slots runs apart, so it
    waits for (and is waited for by) the ops before it that touch what it touches."""
    waves: list[list[tuple[int, Callable[[], Awaitable[Any]] | None]]] = [[]]
    touched: set[tuple[str, str]] = set()  # by the current wave
    split: set[tuple[str, str]] = set()  # by its split ops
    for i, (op, plan) in enumerate(zip(ops, plans, strict=True)):
        these = _touches(names, op)
        if (these & split) or (plan is not None and these & touched):
            waves.append([])
            touched, split = set(), set()
        waves[-1].append((i, plan))
        touched |= these
        if plan is not None:
            split |= these
    return waves


def _checked(replies: list[Any], url: str) -> list[Any]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise StoreError(redact(f"Redis Cluster {url}: {reply}"))
    return replies


def _pick(values: Sequence[Any] | None, members: list[int]) -> list[Any] | None:
    return None if values is None else [values[i] for i in members]


def _sub_hit(op: Hit, limits: list[int], taken: list[int]) -> Hit:
    """The part of ``op`` one slot decides: its limits and its slot keys there."""
    slots = op.slots or ()
    return Hit(
        [op.keys[i] for i in limits],
        [op.amounts[i] for i in limits],
        [op.windows[i] for i in limits],
        cost=op.cost,
        algorithms=_pick(op.algorithms, limits),
        bursts=_pick(op.bursts, limits),
        slots=[slots[j] for j in taken] or None,
        caps=[op.caps[j] for j in taken],
    )
